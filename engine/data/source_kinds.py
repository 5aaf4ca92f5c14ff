"""One token source, however the config spells it, and a registry of the kinds of source.

A source is named by the flat fields of `[data]` or `[eval]` (`dataset_path`, or `hf_dataset_name` with its
`hf_dataset_*` fields) or by an entry of `[[data.datasets]]` (`path`, `embedded`, or `hf_name` with its `hf_*`
fields). Each spelling is read into one `SourceSpec` here; the loader asks `source_directory` for the shard
directory of any spec, which looks the spec's kind up in `SOURCE_KINDS`. The flat `[data]` fields are the
one-entry list of `train_sources` (the embedded corpus's training split when they name nothing). A new kind of
source is one function registered with `register_source_kind`, not a branch in the loader.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config.data import HubDatasetFields, MixtureSource
from engine.data.embedded import embedded_corpus
from engine.data.hub_cache import HubRequest, cached_shards

if TYPE_CHECKING:
    from engine.config.job import JobConfig


@dataclass(frozen=True)
class SourceSpec:
    """Where one source's tokens are: its kind (a key of SOURCE_KINDS), what locates it (a path, an embedded
    split, a dataset's name), and the config field that names it (for errors)."""

    kind: str
    location: str
    field: str
    hub: HubRequest | None = None  # a Hugging Face dataset: which split, and the fields that shape it


def section_source(cfg: JobConfig, section: str) -> SourceSpec | None:
    """The source the flat fields of `[data]` or `[eval]` name; None when they name none."""
    values, d = getattr(cfg, section), cfg.data
    if values.dataset_path:
        return SourceSpec("shards", values.dataset_path, f"{section}.dataset_path")
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
        return SourceSpec("shards", source.path, f"{where}.path")
    assert source.embedded is not None, "validation requires one of path, embedded, hf_name"
    return SourceSpec("embedded", source.embedded, f"{where}.embedded")


def train_sources(cfg: JobConfig) -> list[SourceSpec]:
    """The training sources: the `[[data.datasets]]` entries, or the flat `[data]` fields as a one-entry list."""
    if cfg.data.datasets:
        return [entry_source(cfg, i) for i in range(len(cfg.data.datasets))]
    return [section_source(cfg, "data") or SourceSpec("embedded", "train", "data.dataset_path")]


SourceKind = Callable[[SourceSpec, "JobConfig", Callable[[], Path]], Path]
SOURCE_KINDS: dict[str, SourceKind] = {}


def register_source_kind(kind: str, directory: SourceKind) -> None:
    """`directory(spec, cfg, tokenizer)` gives the shard directory of a spec of this kind; `tokenizer()` is the
    tokenizer.json to tokenize with, for a kind that builds its shards on first use."""
    SOURCE_KINDS[kind] = directory


def source_directory(cfg: JobConfig, spec: SourceSpec, tokenizer: Callable[[], Path]) -> Path:
    """The shard directory of `spec`, built on first use where its kind builds one."""
    return SOURCE_KINDS[spec.kind](spec, cfg, tokenizer)


def hub_directory(spec: SourceSpec, cfg: JobConfig, tokenizer: Callable[[], Path]) -> Path:
    assert spec.hub is not None
    return cached_shards(spec.hub, cfg.data.hf_streaming, tokenizer(), cfg.model.vocab_size)


register_source_kind("shards", lambda spec, cfg, tokenizer: Path(spec.location))
register_source_kind("embedded", lambda spec, cfg, tokenizer: embedded_corpus().split(spec.location))
register_source_kind("hf", hub_directory)
