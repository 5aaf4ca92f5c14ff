"""One token source, however it is spelled, and how the registry of source kinds resolves it.

A source is named by the flat fields of `[data]` or `[eval]` (`dataset_path`, or `hf_dataset_name` with its
`hf_dataset_*` fields), by an entry of `[[data.datasets]]` (`path`, `embedded`, or `hf_name` with its `hf_*`
fields; each section also takes the other spelling of these keys, engine/config/data.py: SPELLINGS), or by
`forge extract` / `forge eval --data`. A path field and `--data` take one string spelling (`parse_source`):
a local folder, a URL (`s3://…`, `gs://…`, `https://…`, `memory://…`), or `KIND:LOCATION` for a kind
registered as nameable that way (`embedded:val`). Each spelling reads into one `SourceSpec`; the loader asks
`source_directory` for the shard directory of any spec, which looks the spec's kind up in `SOURCE_KINDS`
(engine/config/registry.py; the kinds are registered in engine/data/kinds.py, the one registry `forge tokenize`
opens its `KIND:NAME` inputs through too). The flat `[data]` fields are the one-entry list of `train_sources`
(the embedded corpus's training split when they name nothing). A new kind of source is one registration, not a
branch in the loader.

Torch-free and cheap to import (engine/data/rules.py checks kind names at validation): each kind imports
what it needs when it resolves a spec.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config.data import MixtureSource
from engine.config.registry import SOURCE_KINDS, SourceKind, resolved
from engine.data.kinds import HubDatasetFields
from engine.errors import UserError

if TYPE_CHECKING:
    from engine.config.job import JobConfig
    from engine.data.hub_cache import HubRequest
    from engine.data.shards import Manifest


@dataclass(frozen=True)
class SourceSpec:
    """Where one source's tokens are: its kind (a name registered in SOURCE_KINDS), what locates it (a path, a URL, an
    embedded split, a dataset's name), and the config field (or flag) that names it, for errors."""

    kind: str  # a name in SOURCE_KINDS
    location: str
    field: str
    hub: HubRequest | None = None  # a Hugging Face dataset: which split, and the fields that shape it


PREFIX = re.compile(r"([A-Za-z][A-Za-z0-9_+.-]*):(?!//)(.*)", re.DOTALL)


def prefixed_kind(name: str) -> SourceKind | None:
    """The registered kind a path may name as `name:LOCATION`, if any."""
    return next((kind for kind in SOURCE_KINDS.prefixed() if kind.name == name), None)


def unknown_kind(text: str) -> str | None:
    """The KIND of a `KIND:LOCATION` spelling that names no registered kind nameable that way, if any."""
    match = PREFIX.fullmatch(text)
    if match is None or "://" in text:
        return None
    return None if prefixed_kind(match.group(1)) is not None else match.group(1)


def kinds_hint(leave_out: tuple[str, ...] = ()) -> str:
    prefixed = [f"{kind.name}:…" for kind in SOURCE_KINDS.prefixed() if kind.name not in leave_out]
    return f"write a folder, a URL (s3://, gs://, https://…) or one of {', '.join(prefixed)}"


def parse_source(text: str, field: str) -> SourceSpec:
    """The source a path field or `--data` names: a URL, `KIND:LOCATION`, or else a folder of shards."""
    if "://" in text:
        return SourceSpec("remote", text, field)
    wrong = unknown_kind(text)
    if wrong is not None:
        raise UserError(f"{field} {text!r}: there is no source kind {wrong!r}", kinds_hint())
    match = PREFIX.fullmatch(text)
    return SourceSpec(match.group(1), match.group(2), field) if match else SourceSpec("shards", text, field)


def section_source(cfg: JobConfig, section: str) -> SourceSpec | None:
    """The source the flat fields of `[data]` or `[eval]` name; None when they name none."""
    from engine.data.hub_cache import HubRequest

    values, d = getattr(cfg, section), cfg.data
    if values.dataset_path:
        return parse_source(values.dataset_path, f"{section}.dataset_path")
    if not values.hf_dataset_name:
        return None
    fields = ", ".join(f"{section}.{field}" for field in HubDatasetFields.model_fields)
    request = HubRequest(
        values.hf_dataset_name,
        values.hf_dataset_config,
        values.hf_dataset_split,
        values.hf_dataset_revision,
        d.hf_dataset_text_field,
        f"{section}.hf_dataset_name",
        f"{fields} and data.hf_dataset_text_field",
    )
    return SourceSpec("hf", values.hf_dataset_name, f"{section}.hf_dataset_name", request)


def entry_source(cfg: JobConfig, index: int) -> SourceSpec:
    """The source of `[[data.datasets]]` entry `index` (validation guarantees it names exactly one location)."""
    from engine.data.hub_cache import HubRequest

    source, where = cfg.data.datasets[index], f"data.datasets.{index}"
    if source.hf_name is not None:
        fields = ", ".join(f"{where}.{field}" for field in ("hf_name", *MixtureSource.HUB_FIELDS))
        request = HubRequest(
            source.hf_name,
            source.hf_config,
            source.hf_split,
            source.hf_revision,
            source.text_field,
            f"{where}.hf_name",
            fields,
        )
        return SourceSpec("hf", source.hf_name, f"{where}.hf_name", request)
    if source.path is not None:
        return parse_source(source.path, f"{where}.path")
    assert source.embedded is not None, "validation requires one of path, embedded, hf_name"
    return SourceSpec("embedded", source.embedded, f"{where}.embedded")


def train_sources(cfg: JobConfig) -> list[SourceSpec]:
    """The training sources: the `[[data.datasets]]` entries, or the flat `[data]` fields as a one-entry list."""
    if cfg.data.datasets:
        return [entry_source(cfg, i) for i in range(len(cfg.data.datasets))]
    return [section_source(cfg, "data") or SourceSpec("embedded", "train", "data.dataset_path")]


def source_directory(cfg: JobConfig, spec: SourceSpec, tokenizer: Callable[[], Path]) -> Path:
    """The shard directory of `spec`, built (or fetched) on first use where its kind builds one."""
    return resolved(SOURCE_KINDS.get(spec.kind).build)(spec, cfg, tokenizer)


def source_manifest(cfg: JobConfig, spec: SourceSpec) -> Manifest:
    """The manifest of `spec`'s shards: read from the store for a remote data set, without fetching it."""
    from engine.data.shards import read_manifest

    kind = SOURCE_KINDS.get(spec.kind)
    if kind.manifest is not None:
        return resolved(kind.manifest)(spec)
    return read_manifest(source_directory(cfg, spec, lambda: train_tokenizer_path(cfg)))


def train_tokenizer_path(cfg: JobConfig) -> Path:
    """What a kind that tokenizes on first use would encode with, for `source_manifest`: data.tokenizer_path."""
    if cfg.data.tokenizer_path is None:
        raise UserError("data.tokenizer_path is unset", "set it to the tokenizer.json to tokenize the source with")
    return Path(cfg.data.tokenizer_path)


def shards_directory(spec: SourceSpec, cfg: JobConfig, tokenizer: Callable[[], Path]) -> Path:
    return Path(spec.location)


def embedded_directory(spec: SourceSpec, cfg: JobConfig, tokenizer: Callable[[], Path]) -> Path:
    from engine.data.embedded import SPLITS, embedded_corpus

    if spec.location not in SPLITS:
        raise UserError(
            f"{spec.field} embedded:{spec.location}: the embedded corpus has no split {spec.location!r}",
            f"use one of {', '.join('embedded:' + s for s in SPLITS)} (embedded:val: the held-out works)",
        )
    return embedded_corpus().split(spec.location)


def hub_directory(spec: SourceSpec, cfg: JobConfig, tokenizer: Callable[[], Path]) -> Path:
    from engine.data.hub_cache import cached_shards

    if spec.hub is None:  # `hf:NAME` in a path field: validation refuses it, this names it for an unvalidated config
        raise UserError(
            f"{spec.field} hf:{spec.location} names a Hugging Face dataset",
            "name it with hf_dataset_name (hf_name in [[data.datasets]]) and its split and revision fields",
        )
    return cached_shards(spec.hub, cfg.data.hf_streaming, tokenizer(), cfg.model.vocab_size)


def remote_directory(spec: SourceSpec, cfg: JobConfig, tokenizer: Callable[[], Path]) -> Path:
    from engine.data.remote_shards import fetched_shards

    return fetched_shards(spec.location, spec.field)


def remote_manifest(spec: SourceSpec) -> Manifest:
    from engine.data.remote_shards import remote_manifest

    return remote_manifest(spec.location, spec.field)[0]
