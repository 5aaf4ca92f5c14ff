"""The cross-section rules of the data a run reads (engine/data/): each source named in exactly one place,
evaluation with data of its own, a source kind's fields only beside a source of that kind (the Hugging Face
fields only beside a Hugging Face dataset), and mixtures whose phases name their sources, in order, inside the
run.

Torch-free, like every room's rules module: it imports engine.config's sections and helpers, and the
registry of source kinds (engine/data/source_kinds.py, which imports what a kind needs only when it resolves
one), `JobConfig` for its types alone; engine/plan/checks.py runs these functions in the order it lists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config.data import EMBEDDED_SPLITS, MixtureSource
from engine.config.fields import changed_fields
from engine.data.kinds import HubDatasetFields
from engine.errors import ConfigIssue

if TYPE_CHECKING:
    from engine.config.job import JobConfig


def source_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """Evaluation needs held-out data of its own when training reads its own (unless it only runs eval.tasks);
    then the Hugging Face fields."""
    issues: list[ConfigIssue] = []
    own_data = cfg.data.dataset_path is not None or cfg.data.hf_dataset_name is not None
    own_data = own_data or any(source.embedded is None for source in cfg.data.datasets)
    held_out_named = cfg.eval.dataset_path is not None or cfg.eval.hf_dataset_name is not None
    # eval.tasks alone needs no held-out data: then the loss on held-out data is simply not measured
    if cfg.eval.enabled and not held_out_named and own_data and not cfg.eval.tasks:
        issues.append(
            ConfigIssue(
                "eval.dataset_path",
                "eval is enabled but has no data source",
                "set eval.dataset_path to held-out shards (or eval.hf_dataset_name), or eval.enabled = false",
            )
        )
    return issues + kind_field_issues(cfg)


def kind_field_issues(cfg: JobConfig) -> list[ConfigIssue]:
    """The fields of `[data]` a kind of source owns (engine/data/kinds.py), set where no source of that kind
    reads them: each kind's own rule where its registration names one (the Hugging Face kind's fields also serve
    `[eval]`), else refused naming the kinds that read them when no source the config names is of those kinds."""
    from engine.config.registry import SOURCE_KINDS, resolved

    named = named_kinds(cfg)
    owners = SOURCE_KINDS.owners()
    issues: list[ConfigIssue] = []
    for kind in SOURCE_KINDS.components():
        if kind.rule is not None:
            issues += resolved(kind.rule)(cfg)
            continue
        for field in changed_fields(cfg.data, kind.config.model_fields):
            readers = owners[field]
            if readers[0] == kind.name and not named & set(readers):
                listed = ", ".join(readers)
                issues.append(
                    ConfigIssue(
                        f"data.{field}",
                        f"is set, but no source is of kind {listed} (only {listed} sources read it)",
                        f"name a source {kind.example or kind.describe}, or remove it",
                    )
                )
    return issues


def named_kinds(cfg: JobConfig) -> set[str]:
    """The kinds of the sources the config names for training and evaluation (a spelling that names no kind
    is left to `source_kind_issues`)."""
    from engine.data.source_kinds import entry_source, parse_source, section_source
    from engine.errors import UserError

    named = [lambda: section_source(cfg, "data"), lambda: section_source(cfg, "eval")]
    named += [
        lambda i=i: entry_source(cfg, i)
        for i, s in enumerate(cfg.data.datasets)
        if any(getattr(s, location) is not None for location in MixtureSource.LOCATIONS)
    ]
    named += [
        lambda i=i, text=s.eval_path: parse_source(text, f"data.datasets.{i}.eval_path")
        for i, s in enumerate(cfg.data.datasets)
        if s.eval_path is not None
    ]
    kinds = set()
    for spec in named:
        try:
            found = spec()
        except UserError:
            continue
        if found is not None:
            kinds.add(found.kind)
    return kinds


def hub_data_issues(cfg: JobConfig) -> list[ConfigIssue]:
    """A Hugging Face dataset replaces shards, needs a tokenizer to be encoded with, and its fields mean
    nothing without it. (Like eval.dataset_path, the eval ones may stay set while evaluation is off.)"""
    issues: list[ConfigIssue] = []
    fields = [field for field in HubDatasetFields.model_fields if field != "hf_dataset_name"]
    for section, values in (("data", cfg.data), ("eval", cfg.eval)):
        if values.hf_dataset_name is None:
            issues += [
                ConfigIssue(
                    f"{section}.{field}",
                    f"is set, but {section}.hf_dataset_name is unset",
                    f"set {section}.hf_dataset_name, or remove it",
                )
                for field in changed_fields(values, fields)
            ]
        elif values.dataset_path is not None:
            issues.append(
                ConfigIssue(
                    f"{section}.hf_dataset_name",
                    f"and {section}.dataset_path are both set",
                    "train (or evaluate) on one of them",
                )
            )
    named = cfg.data.hf_dataset_name is not None or cfg.eval.hf_dataset_name is not None
    streamed = named or any(source.hf_name is not None for source in cfg.data.datasets)
    readers = {
        "hf_dataset_text_field": (named, "neither data.hf_dataset_name nor eval.hf_dataset_name is"),
        "hf_streaming": (streamed, "no dataset is named (data.hf_dataset_name, eval.hf_dataset_name, hf_name)"),
    }
    issues += [
        ConfigIssue(f"data.{field}", f"is set, but {readers[field][1]}", "name a dataset, or remove it")
        for field in changed_fields(cfg.data, readers)
        if not readers[field][0]
    ]
    if cfg.data.hf_dataset_name is not None and cfg.data.tokenizer_path is None:
        issues.append(
            ConfigIssue(
                "data.tokenizer_path",
                "is needed to tokenize data.hf_dataset_name",
                "point it at a tokenizer.json (e.g. one written by forge tokenize)",
            )
        )
    return issues


def mixture_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """Sources named once and used alone; phases in order, inside the run, naming only sources."""
    d, max_steps = cfg.data, cfg.train.max_steps
    if not d.datasets:
        fields = ("mix_temperature", "phases", "anneal_start_step", "anneal_weights")
        return [
            ConfigIssue(f"data.{field}", "is set, but data.datasets lists no sources", "add [[data.datasets]] entries")
            for field in changed_fields(d, fields)
        ]
    issues = [
        ConfigIssue(f"data.{field}", "and data.datasets are both set", "list the data set as a [[data.datasets]] entry")
        for field in ("dataset_path", "hf_dataset_name")
        if getattr(d, field) is not None
    ]
    issues += source_location_issues(d.datasets, d.tokenizer_path)
    names = [source.name for source in d.datasets]
    issues += [
        ConfigIssue(f"data.datasets.{i}.name", f"{name!r} names an earlier source too", "give each source its own name")
        for i, name in enumerate(names)
        if name in names[:i]
    ]
    if (d.anneal_start_step is None) != (d.anneal_weights is None):
        missing = "anneal_weights" if d.anneal_weights is None else "anneal_start_step"
        issues.append(ConfigIssue(f"data.{missing}", "is needed by the anneal shorthand", f"set data.{missing}"))
    if d.phases and d.anneal_start_step is not None:
        issues.append(
            ConfigIssue("data.anneal_start_step", "and data.phases are both set", "write the anneal as a last phase")
        )
    declared = [(f"data.phases.{i}", p.start_step, p.dataset_weights) for i, p in enumerate(d.phases)]
    if d.anneal_start_step is not None and d.anneal_weights is not None:
        declared.append(("data.anneal", d.anneal_start_step, d.anneal_weights))
    for k, (where, start, weights) in enumerate(declared):
        start_field = "data.anneal_start_step" if where == "data.anneal" else f"{where}.start_step"
        weights_field = "data.anneal_weights" if where == "data.anneal" else f"{where}.dataset_weights"
        if k and start <= declared[k - 1][1]:
            issues.append(
                ConfigIssue(
                    start_field,
                    f"{start} is not after the previous phase's {declared[k - 1][1]}",
                    "sort the phases by start_step",
                )
            )
        if start >= max_steps:
            issues.append(
                ConfigIssue(
                    start_field,
                    f"{start} is not before train.max_steps ({max_steps})",
                    f"move it below {max_steps} too (--{start_field}=N): a phase starts at a step, it does not "
                    "scale with train.max_steps",
                )
            )
        unknown = sorted(set(weights) - set(names))
        if unknown:
            issues.append(
                ConfigIssue(
                    weights_field,
                    f"names unknown source(s) {', '.join(unknown)}",
                    f"use names of data.datasets: {', '.join(names)}",
                )
            )
        if not weights:
            issues.append(ConfigIssue(weights_field, "is empty", "give at least one source a weight"))
    return issues


def source_location_issues(sources: list[MixtureSource], tokenizer_path: str | None) -> list[ConfigIssue]:
    """Each source in exactly one place (shards, the embedded corpus, a Hugging Face dataset), the Hugging
    Face fields only beside hf_name, and a tokenizer to encode the Hugging Face sources with."""
    issues = []
    for i, source in enumerate(sources):
        where = f"data.datasets.{i}"
        given = [field for field in MixtureSource.LOCATIONS if getattr(source, field) is not None]
        if len(given) != 1:
            issues.append(
                ConfigIssue(
                    f"{where}.{given[-1] if given else 'path'}",
                    f"and {where}.{given[0]} are both set" if given else "is unset, and so are embedded and hf_name",
                    "give exactly one of path (forge tokenize output), embedded (a corpus split) or hf_name "
                    "(a Hugging Face dataset)",
                )
            )
        if source.hf_name is None:
            issues += [
                ConfigIssue(f"{where}.{field}", f"is set, but {where}.hf_name is unset", "remove it, or set hf_name")
                for field in changed_fields(source, MixtureSource.HUB_FIELDS)
            ]
    hub = [i for i, source in enumerate(sources) if source.hf_name is not None]
    if hub and tokenizer_path is None and all(source.hf_name is not None for source in sources):
        issues.append(
            ConfigIssue(
                "data.tokenizer_path",
                f"is needed to tokenize data.datasets.{hub[0]}.hf_name (no source has shards with a tokenizer)",
                "point it at a tokenizer.json (e.g. one written by forge tokenize)",
            )
        )
    return issues


def source_kind_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """A path field names a folder, a URL, or `KIND:LOCATION` for a kind the registry lets a path name: not an
    unknown kind, not a Hugging Face dataset (its own fields say which split and revision), and an embedded
    split that exists (training: not the held-out `val`)."""
    from engine.data.source_kinds import PREFIX, kinds_hint, unknown_kind

    train = [("data.dataset_path", cfg.data.dataset_path)]
    train += [(f"data.datasets.{i}.path", source.path) for i, source in enumerate(cfg.data.datasets)]
    held_out = [("eval.dataset_path", cfg.eval.dataset_path)]
    held_out += [(f"data.datasets.{i}.eval_path", source.eval_path) for i, source in enumerate(cfg.data.datasets)]
    issues = []
    for fields, splits in ((train, EMBEDDED_SPLITS), (held_out, ("val", *EMBEDDED_SPLITS))):
        for field, text in fields:
            match = PREFIX.fullmatch(text or "")
            if text is None or match is None or "://" in text:
                continue
            kind, location = match.groups()
            if unknown_kind(text) is not None:
                issues.append(ConfigIssue(field, f"{text!r}: there is no source kind {kind!r}", kinds_hint(("hf",))))
            elif kind == "hf":
                issues.append(ConfigIssue(field, f"{text!r} names a Hugging Face dataset", hub_hint(field, location)))
            elif kind == "embedded" and location not in splits:
                issues.append(
                    ConfigIssue(
                        field,
                        f"the embedded corpus has no split {location!r} here",
                        f"use one of {', '.join('embedded:' + s for s in splits)}",
                    )
                )
    return issues


def hub_hint(field: str, name: str) -> str:
    """Where a Hugging Face dataset is named instead of the path field `field`: its own fields give the split."""
    where, key = field.rsplit(".", 1)
    if key == "eval_path":
        return f"a source's held-out set is shards: forge tokenize hf:{name} --out DIR, then {field} = DIR"
    own = "hf_name" if where.startswith("data.datasets.") else "hf_dataset_name"
    return f"set {where}.{own} = {name!r} instead (with its split and revision fields)"
