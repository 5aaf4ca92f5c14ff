"""`[data]`: where training tokens come from.

The fields every source kind shares (the path, the tokenizer, the mixture, the loader's) are declared here; each
kind of source declares its own in the class it is registered with (engine/data/kinds.py: the `hf_*` fields are
the Hugging Face kind's), and `DataConfig`, the `[data]` table, is composed of them all
(engine/config/registry.py: `SOURCE_KINDS`). A kind's field set where no source of that kind reads it is a config
error naming the kind (engine/data/rules.py), so no field is silently ignored.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from engine.config.base import Section
from engine.config.registry import SOURCE_KINDS


class DataFiles(Section):
    """The fields `[data]` lists before its Hugging Face dataset fields."""

    dataset_path: str | None = Field(
        None,
        description="directory written by `forge tokenize`, local or a URL (s3://, gs://, https://, memory://: "
        "fetched once into the Forge cache), or embedded:SPLIT; unset (and no hf_dataset_name) = the embedded "
        "Shakespeare corpus. Also spelled path",
    )
    file_pattern: str = Field("*.npy", description="glob of shard files inside dataset_path")
    tokenizer_path: str | None = Field(
        None,
        description="tokenizer.json; must match the manifest's tokenizer. Unset = the one beside the shards. "
        "Required with hf_dataset_name",
    )


SPELLINGS = {  # a [[data.datasets]] entry's key → the same key of the flat [data] / [eval] fields
    "path": "dataset_path",
    "hf_name": "hf_dataset_name",
    "hf_config": "hf_dataset_config",
    "hf_split": "hf_dataset_split",
    "hf_revision": "hf_dataset_revision",
    "text_field": "hf_dataset_text_field",
}
"""One source, one set of keys: each of `[data]`, `[eval]` and a `[[data.datasets]]` entry takes either
spelling of these keys (`engine.config.loader` reads the other one as the section's own, so the resolved
config shows one); both spellings of one key in one table is an error naming them."""


def other_spellings(fields: dict) -> dict[str, str]:
    """The other spelling → the field it means, for a section whose fields are `fields`."""
    both = {**SPELLINGS, **{flat: entry for entry, flat in SPELLINGS.items()}}
    return {other: own for own, other in both.items() if own in fields and other not in fields}


EMBEDDED_SPLITS = ("train", "plays", "poems")  # engine/data/embedded.py builds them; "val" is held out for eval
PositiveWeight = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class MixtureSource(Section):
    """One `[[data.datasets]]` entry: a source of training tokens and its share of the mixture. Exactly one of
    path, embedded and hf_name says where its tokens are (engine/data/rules.py: mixture_issues)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="what phases and metrics call this source")
    path: str | None = Field(
        None,
        description="directory written by `forge tokenize`, local or a URL (fetched once into the Forge cache), "
        "or embedded:SPLIT. Also spelled dataset_path",
    )
    embedded: Literal[EMBEDDED_SPLITS] | None = Field(  # type: ignore[valid-type]
        None,
        description="a split of the embedded Shakespeare corpus instead of path: train (every training work), "
        "or its two disjoint parts, plays and poems",
    )
    hf_name: str | None = Field(
        None,
        description="a Hugging Face dataset (Hub id or local folder) instead of path: tokenized once into the "
        "Forge cache like data.hf_dataset_name, with data.tokenizer_path (else the tokenizer beside the first "
        "path or embedded source). Also spelled hf_dataset_name, and each hf_* field hf_dataset_*",
    )
    hf_config: str | None = Field(None, description="hf_name's configuration (subset)")
    hf_split: str = Field("train", description="hf_name's split")
    hf_revision: str | None = Field(None, description="hf_name's Hub branch, tag or commit")
    text_field: str = Field(
        "text", description="hf_name's column that holds the text. Also spelled hf_dataset_text_field"
    )
    weight: PositiveWeight = Field(1.0, description="relative share before mix_temperature; must be > 0")
    eval_path: str | None = Field(
        None,
        description="held-out shards of this source (same tokenizer; a folder, a URL or embedded:SPLIT): with "
        "eval.enabled, also evaluated on their own, as eval_loss/NAME",
    )

    LOCATIONS: ClassVar[tuple[str, ...]] = ("path", "embedded", "hf_name")
    HUB_FIELDS: ClassVar[tuple[str, ...]] = ("hf_config", "hf_split", "hf_revision", "text_field")


class DataPhase(Section):
    """One `[[data.phases]]` entry: from `start_step` on, these mixture weights and this lr multiplier."""

    start_step: int = Field(ge=0, description="0-based step from which the phase applies")
    dataset_weights: dict[str, PositiveWeight] = Field(
        description="source name → weight (> 0) in this phase; a source left out is not drawn from"
    )
    lr_scale: float = Field(1.0, gt=0, description="multiplies the scheduler's lr from start_step on")


class Mixture(Section):
    """The mixture fields of `[data]` (pydantic puts a base's fields first)."""

    datasets: list[MixtureSource] = Field(
        default_factory=list,
        description="[[data.datasets]] {name, path | embedded | hf_name (+ hf_config, hf_split, hf_revision, "
        "text_field), weight, eval_path}: train on a weighted mixture of sources instead of dataset_path "
        "(docs/data.md#mixtures)",
    )
    mix_temperature: float = Field(
        1.0, gt=0, description="source i is drawn with probability w_i^(1/T) / sum_j w_j^(1/T) (T = 1: as given)"
    )
    phases: list[DataPhase] = Field(
        default_factory=list,
        description="[[data.phases]] {start_step, dataset_weights, lr_scale}: mixture weights and lr multiplier "
        "from each start_step on; before the first, the datasets' weights and scale 1",
    )
    anneal_start_step: int | None = Field(
        None, ge=0, description="shorthand for one final phase: from this step on, anneal_weights (lr_scale 1)"
    )
    anneal_weights: dict[str, PositiveWeight] | None = Field(
        None, description="source name → weight of the anneal phase (needs anneal_start_step)"
    )


class DataFields(Mixture, DataFiles):
    """The fields of `[data]` that no one kind of source owns."""

    num_workers: int = Field(0, ge=0, description="DataLoader worker processes")
    pin_memory: bool = Field(False, description="pin host batches (GPU only)")
    prefetch_factor: int | None = Field(None, gt=0, description="batches prefetched per worker (needs num_workers > 0)")
    pack_sequences: bool = Field(
        False,
        description="document-aware packing: a window's documents (ended by the tokenizer's end-of-document "
        "token) attend only within themselves and restart their RoPE positions at 0 (see docs/data.md)",
    )

    @model_validator(mode="after")
    def _prefetch_needs_workers(self) -> DataFields:
        if self.prefetch_factor is not None and self.num_workers == 0:
            raise ValueError("prefetch_factor needs num_workers > 0")
        return self


class DataConfig(DataFields):
    """The `[data]` table: the shared fields and every registered source kind's own ones (composed by
    `SOURCE_KINDS.bind` below)."""


LISTED = (
    *DataFiles.model_fields,
    "hf_dataset_name",
    "hf_dataset_config",
    "hf_dataset_split",
    "hf_dataset_revision",
    *Mixture.model_fields,
    "hf_dataset_text_field",
    "hf_streaming",
)
"""The order the resolved `[data]` has always listed its keys in (`forge validate-config`, every saved config.toml;
the validate goldens pin it): the Hugging Face kind's fields amid the shared ones. The rest of the shared fields
follow, then the fields of a kind registered later."""

import engine.data.kinds  # noqa: E402, F401  (registers every source kind's fields: torch-free)

SOURCE_KINDS.bind(DataConfig, DataFields, order=(*LISTED, *DataFields.model_fields))
