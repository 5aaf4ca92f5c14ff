"""Small name → entry registries for the components a config picks by string, and the registries of
components that make up a section (`ComponentRegistry`).

Most entries are builders: a norm or a router registers its builder. The optimizers, the schedules and the model
families are components (`Component`): a torch-free config class of their own fields and what they build (a
family: its `ModelSpec`, engine/model/spec.py), and the `[optimizer]`, `[scheduler]` and `[model]` sections are
composed from them (`[model]` chooses by `model_type`, the others by `name`).

A component's class derives from its section's shared fields (`OptimizerFields`, `SchedulerFields`, `ModelFields`) and declares
the fields only it reads, in its own module beside its implementation (engine/train/optim/muon_config.py); one
decorator registers it with the implementation it builds, named as "module:attribute" so that registering imports
no torch:

    @OPTIMIZERS.register("muon", build="engine.train.optim.muon:muon")
    class MuonConfig(AdamEps): ...

The TOML table stays flat: the section (`OptimizerConfig`) is composed from the shared fields and every registered
component's own ones (`ComponentRegistry.compose`), recomposed when a component registers later, and its name field
takes exactly the registered names (a `Literal` built here from the registry, so pydantic's message lists them). A
field is owned by the components whose class declares it; set away from its default while another component is
chosen, it is an error naming its owners (`owner_issues`), so no field is silently ignored, and a config that
leaves it at its default (as every run directory's saved config.toml does) loads. What the chosen component reads
is its own config object, `chosen(values)`: the section's values of the fields its class declares.

Two sections are composed without a name field. `[data]` of the source kinds (`SOURCE_KINDS`, a
`SourceKindRegistry`: a path's spelling or a kind's own location field picks the kind, and `forge tokenize` opens
its `KIND:NAME` inputs through the same registry) and `[metrics]` of the metrics sinks (`METRICS_SINKS`, a
`SinkRegistry`: several on at once, each by its own switch field). Both keep the key order their tables always had
(`bind(order=...)`), and refuse a kind's or a sink's field where no source of that kind is named or the sink is off.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from engine.config.base import Section
from engine.errors import ConfigIssue

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._builders: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(builder: T) -> T:
            assert name not in self._builders, f"{self.kind} {name!r} registered twice"
            self._builders[name] = builder
            return builder

        return add

    def get(self, name: str) -> T:
        if name not in self._builders:
            close = difflib.get_close_matches(name, self._builders, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown {self.kind} {name!r}{hint} (known: {', '.join(sorted(self._builders))})")
        return self._builders[name]

    def names(self) -> list[str]:
        return sorted(self._builders)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Registrations made inside are undone on leaving (what a test that registers a toy uses)."""
        saved = dict(self._builders)
        try:
            yield
        finally:
            self._builders = saved
            self.changed()

    def changed(self) -> None:
        """Called when the entries change; a component registry recomposes its section."""


@dataclass(frozen=True)
class Component:
    """One registered choice: its name, its config class (shared and own fields) and what it builds, as
    "module:attribute" (imported only when built) or the object itself."""

    name: str
    config: type[Section]
    build: str | Callable[..., Any] | None = None
    spec: Any = None
    """What the component says of itself besides its fields (a model family's `ModelSpec`: engine/model/spec.py)."""

    def implementation(self) -> Any:
        return resolved(self.build)


def resolved(named: str | Callable[..., Any] | None) -> Any:
    """What a "module:attribute" names, imported now; anything else as it is."""
    if not isinstance(named, str):
        return named
    module, _, attribute = named.partition(":")
    return getattr(importlib.import_module(module), attribute)


class ComponentRegistry(Registry[Component]):
    """A registry of components whose entries also make up a section (`bind`); `name_field` is the section's
    field that chooses one (`name`, or the model's `model_type`), None where the section's values choose (which
    fields are set: the source kinds) or several components are on at once (the metrics sinks)."""

    def __init__(self, kind: str, name_field: str | None = "name") -> None:
        super().__init__(kind)
        self._name_field = name_field
        self._section: type[Section] | None = None
        self._shared: type[Section] | None = None
        self._order: tuple[str, ...] = ()
        self._tail: tuple[str, ...] = ()
        self._dependents: list[type[BaseModel]] = []

    def register(  # type: ignore[override]
        self, name: str, build: str | Callable[..., Any] | None = None, spec: Any = None
    ) -> Callable[[type], type]:
        """Decorate a component's config class: registered under `name`, building `build` (and described by
        `spec`, for a component that has one)."""

        def add(config: type[Section]) -> type[Section]:
            self.add(Component(name, config, build, spec))
            return config

        return add

    def add(self, component: Component) -> None:
        """Register `component` under its name (once) and recompose the section: what every `register` ends in."""
        assert component.name not in self._builders, f"{self.kind} {component.name!r} registered twice"
        self._builders[component.name] = component
        self.compose()

    def changed(self) -> None:
        self.compose()

    def components(self) -> Iterator[Component]:
        """In registration order (the order the name field lists them)."""
        return iter(self._builders.values())

    def bind(
        self, section: type[Section], shared: type[Section], tail: tuple[str, ...] = (), order: tuple[str, ...] = ()
    ) -> None:
        """Make `section` (a subclass of `shared` that adds no fields) the union of the components' fields:
        `shared`'s, then each component's own in registration order, and the fields named in `tail` last; or,
        where the resolved config has always interleaved them, the fields named in `order` first, in that order
        (the key order of saved run configs and of validate-config's output, which no field's owner decides); a
        field it does not list (a component registered later) follows them."""
        self._section, self._shared, self._tail, self._order = section, shared, tail, order
        section.components = self  # the "read by" column of engine/config/reference.py
        self.compose()

    def rebuild_with(self, model: type[BaseModel]) -> None:
        """`model` embeds the section (JobConfig): rebuilt whenever the section is recomposed."""
        self._dependents.append(model)

    @property
    def name_field(self) -> str | None:
        """The field that chooses one component by name (`name`, the model's `model_type`), or None."""
        return self._name_field

    def compose(self) -> None:
        if self._section is None or self._shared is None:
            return
        fields: dict[str, FieldInfo] = dict(self._shared.model_fields)
        for component in self.components():
            for name, info in component.config.model_fields.items():
                if name in fields:
                    if name not in self._shared.model_fields:
                        self._check_same(name, fields[name], info, component)
                    continue
                fields[name] = copy.copy(info)
        fields = {
            **{k: fields[k] for k in self._order if k in fields},
            **{k: v for k, v in fields.items() if k not in self._tail and k not in self._order},
            **{k: v for k, v in fields.items() if k in self._tail},
        }
        names = tuple(self._builders)
        if names and self.name_field is not None:
            fields[self.name_field] = FieldInfo.merge_field_infos(
                fields[self.name_field],
                annotation=Literal[names],  # type: ignore[valid-type]
            )
        self._section.__pydantic_fields__ = fields
        self._section.model_rebuild(force=True)
        for model in self._dependents:
            model.model_rebuild(force=True)

    def _check_same(self, name: str, first: FieldInfo, again: FieldInfo, component: Component) -> None:
        same = first.annotation == again.annotation and first.get_default(
            call_default_factory=True
        ) == again.get_default(call_default_factory=True)
        assert same, (
            f"{self.kind} {component.name!r} declares {name!r} unlike another {self.kind} does: "
            "declare a shared field once (a mixin both classes derive from)"
        )

    def owners(self) -> dict[str, tuple[str, ...]]:
        """Each component-owned field (not a shared one) → the components whose class declares it."""
        shared = self._shared.model_fields if self._shared is not None else {}
        found: dict[str, list[str]] = {}
        for component in self.components():
            for name in component.config.model_fields:
                if name not in shared:
                    found.setdefault(name, []).append(component.name)
        return {name: tuple(names) for name, names in found.items()}

    def readers(self, field: str) -> tuple[str, ...]:
        """What docs/configuration.md's "read by" column says of `field`: its owners; a shared field, every
        component where one is chosen by name (nothing more to say where none is)."""
        return self.owners().get(field, (f"every {self.kind}",) if self.name_field is not None else ())

    def foreign_fields(self, chosen: str) -> list[str]:
        """The fields other components own and `chosen` does not read (what `forge init` drops)."""
        return [field for field, names in self.owners().items() if chosen not in names]

    def own(self, component: Component, values: Section) -> Any:
        """`component`'s own config object: `values`' fields that its class declares."""
        config = component.config
        return config.model_construct(**{name: getattr(values, name) for name in config.model_fields})

    def chosen(self, values: Section) -> Any:
        """The chosen component's own config object."""
        assert self.name_field is not None, f"no field chooses one {self.kind}"
        return self.own(self.get(getattr(values, self.name_field)), values)

    def owner_issues(self, section: str, values: Section) -> list[ConfigIssue]:
        """One issue per component-owned field set away from its default although the chosen one does not read
        it, naming the components that do."""
        chosen = getattr(values, self.name_field)
        owners = self.owners()
        readers = {field: ", ".join(names) for field, names in owners.items() if chosen not in names}
        defaults = {
            name: info.get_default(call_default_factory=True) for name, info in type(values).model_fields.items()
        }
        return [
            ConfigIssue(
                f"{section}.{field}",
                f"is set, but {chosen!r} does not use it (only {readers[field]} do)",
                f"remove it, or choose one of {readers[field]}",
            )
            for field in type(values).model_fields
            if field in readers and getattr(values, field) != defaults[field]
        ]


@dataclass(frozen=True)
class SourceKind(Component):
    """A kind of token source (engine/data/source_kinds.py: `SourceSpec.kind`). `config` holds its own `[data]`
    fields (most kinds have none); `build`, "module:function" `(spec, cfg, tokenizer) -> Path`, gives training
    its shard directory; `documents`, "module:function" `(location, options) -> Source`, opens `KIND:LOCATION`
    as a `forge tokenize` input (None: not one), and `flags` are the forge tokenize options that apply to it.
    `prefixed`: a path field, `--data` and forge tokenize may name it as `KIND:LOCATION`. `manifest` reads the
    manifest without building or fetching the shards, where it can. `rule`, `(cfg) -> list[ConfigIssue]`,
    refuses its fields where nothing reads them, for a kind whose fields are read more widely than by its own
    sources (the Hugging Face fields of `[data]` also serve `[eval]`'s dataset); None: the generic check of
    engine/data/rules.py (`kind_field_issues`)."""

    describe: str = ""
    example: str = ""
    prefixed: bool = False
    documents: str | Callable[..., Any] | None = None
    flags: tuple[str, ...] = ()
    manifest: str | Callable[..., Any] | None = None
    rule: str | Callable[..., Any] | None = None


class SourceKindRegistry(ComponentRegistry):
    """The one registry of the kinds of token source, for training (engine/data/source_kinds.py resolves a config's
    sources through it) and `forge tokenize` (engine/data/tokenize.py opens its `KIND:NAME` inputs through it).

    It lives here, beside the optimizers', because its kinds' own fields make up `[data]` (bound in
    engine/config/data.py); what a kind does is named "module:function" and imported only when used, so the
    registrations (engine/data/kinds.py) are torch-free. No field chooses a kind: a path's spelling does
    (`KIND:LOCATION`, a URL, a folder), or a kind's own location field (`hf_dataset_name`)."""

    def register(  # type: ignore[override]
        self,
        name: str,
        *,
        directory: str | Callable[..., Any],
        describe: str,
        example: str = "",
        prefixed: bool = False,
        documents: str | Callable[..., Any] | None = None,
        flags: tuple[str, ...] = (),
        manifest: str | Callable[..., Any] | None = None,
        rule: str | Callable[..., Any] | None = None,
    ) -> Callable[[type], type]:
        """Decorate the kind's config class (its own `[data]` fields; `Section` itself for none)."""

        def add(config: type[Section]) -> type[Section]:
            self.add(SourceKind(
                name, config, directory, describe=describe, example=example, prefixed=prefixed,
                documents=documents, flags=flags, manifest=manifest, rule=rule,
            ))  # fmt: skip
            return config

        return add

    def prefixed(self) -> list[SourceKind]:
        """The kinds a path field, `--data` or forge tokenize may name as `KIND:LOCATION`, in registration order."""
        return [kind for kind in self.components() if kind.prefixed]  # type: ignore[misc]

    def inputs(self) -> list[SourceKind]:
        """The kinds forge tokenize opens as `KIND:NAME`."""
        return [kind for kind in self.prefixed() if kind.documents is not None]


@dataclass(frozen=True)
class MetricsSink(Component):
    """Where training metrics go (engine/metrics/trackers.py: `log(step, metrics)`, `close()`). `config` holds its
    own `[metrics]` fields; `build`, "module:function" `(own config, SinkContext) -> sink`, starts it. `switch` is
    its own boolean field that turns it on (None: always on, as metrics.jsonl is). `kept_while_off`: own fields a
    config may hold while it is off without being refused: what names the run it would log into, so that one
    preset runs with the sink turned on or off (tests/seed_presets/llama2_7b_fsdp.toml names its W&B run)."""

    switch: str | None = None
    kept_while_off: tuple[str, ...] = ()


class SinkRegistry(ComponentRegistry):
    """The metrics sinks, several on at once: each registered once with its own `[metrics]` fields (bound in
    engine/config/metrics.py), started by `engine.metrics.trackers.build_trackers` for every sink that is on."""

    def register(  # type: ignore[override]
        self,
        name: str,
        *,
        build: str | Callable[..., Any],
        switch: str | None = None,
        kept_while_off: tuple[str, ...] = (),
    ) -> Callable[[type], type]:
        """Decorate the sink's config class (its own `[metrics]` fields, its switch among them)."""

        def add(config: type[Section]) -> type[Section]:
            assert switch is None or switch in config.model_fields, f"{name}'s switch {switch!r} is not its field"
            self.add(MetricsSink(name, config, build, switch=switch, kept_while_off=kept_while_off))
            return config

        return add

    def sinks(self) -> list[MetricsSink]:
        return list(self.components())  # type: ignore[arg-type]

    def enabled(self, values: Section) -> list[MetricsSink]:
        """The sinks `values` (the `[metrics]` section) turns on, in registration order."""
        return [sink for sink in self.sinks() if sink.switch is None or getattr(values, sink.switch)]

    def owner_issues(self, section: str, values: Section) -> list[ConfigIssue]:
        """One issue per field of a sink that is off, set away from its default (its `kept_while_off` excepted),
        naming the sink and its switch."""
        defaults = {n: info.get_default(call_default_factory=True) for n, info in type(values).model_fields.items()}
        on = {sink.name for sink in self.enabled(values)}
        return [
            ConfigIssue(
                f"{section}.{field}",
                f"is set, but the {sink.name} sink is off (only {sink.name} reads it)",
                f"set {section}.{sink.switch} = true, or remove it",
            )
            for sink in self.sinks()
            if sink.name not in on
            for field in sink.config.model_fields
            if field not in (sink.switch, *sink.kept_while_off) and getattr(values, field) != defaults[field]
        ]


NORMS: Registry = Registry("norm")
ACTIVATIONS: Registry = Registry("activation")
OPTIMIZERS = ComponentRegistry("optimizer")
SCHEDULERS = ComponentRegistry("scheduler")
SOURCE_KINDS = SourceKindRegistry("source kind", name_field=None)
METRICS_SINKS = SinkRegistry("metrics sink", name_field=None)
LOSSES: Registry = Registry("loss")
MODELS = ComponentRegistry("model type", name_field="model_type")
ROUTERS: Registry = Registry("MoE router")
