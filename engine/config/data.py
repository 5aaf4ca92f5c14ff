"""`[data]`: where training tokens come from; and the Hugging Face dataset fields `[data]` and `[eval]` share."""

from __future__ import annotations

from pydantic import Field, model_validator

from engine.config.base import Section


class HubDatasetFields(Section):
    """A Hugging Face dataset a section reads instead of shards (`data.hf_*` to train on, `eval.hf_*` to
    evaluate on): fields of the section itself, so the TOML and the error paths stay flat
    (`eval.hf_dataset_split`). Pydantic puts a base's fields first; a section that wants fields before these
    takes them from a base listed after this one (see DataConfig, EvalConfig)."""

    hf_dataset_name: str | None = Field(
        None,
        description="a Hugging Face dataset (Hub id or local folder) instead of dataset_path: tokenized once "
        "with data.tokenizer_path into the Forge cache, then read like shards",
    )
    hf_dataset_config: str | None = Field(None, description="hf_dataset_name's configuration (subset)")
    hf_dataset_split: str = Field("train", description="hf_dataset_name's split")
    hf_dataset_revision: str | None = Field(
        None, description="hf_dataset_name's Hub branch, tag or commit; a commit keeps a long run's data fixed"
    )


class DataFiles(Section):
    """The fields `[data]` lists before its Hugging Face dataset fields."""

    dataset_path: str | None = Field(
        None,
        description="directory written by `forge tokenize`; unset (and no hf_dataset_name) = the embedded "
        "Shakespeare corpus",
    )
    file_pattern: str = Field("*.npy", description="glob of shard files inside dataset_path")
    tokenizer_path: str | None = Field(
        None, description="tokenizer.json; must match the manifest's tokenizer. Unset = the one beside the shards"
    )


class DataConfig(HubDatasetFields, DataFiles):
    hf_dataset_text_field: str = Field(
        "text", description="the column that holds the text (also for eval.hf_dataset_name)"
    )
    hf_streaming: bool = Field(
        False, description="tokenize hf datasets from a stream instead of downloading them first (also for eval)"
    )
    num_workers: int = Field(0, ge=0, description="DataLoader worker processes")
    pin_memory: bool = Field(False, description="pin host batches (GPU only)")
    prefetch_factor: int | None = Field(None, gt=0, description="batches prefetched per worker (needs num_workers > 0)")

    @model_validator(mode="after")
    def _prefetch_needs_workers(self) -> DataConfig:
        if self.prefetch_factor is not None and self.num_workers == 0:
            raise ValueError("prefetch_factor needs num_workers > 0")
        return self
