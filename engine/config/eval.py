"""`[eval]`: in-loop evaluation on held-out shards."""

from __future__ import annotations

from pydantic import Field

from engine.config.base import Section


class EvalConfig(Section):
    enabled: bool = False
    interval: int = Field(100, gt=0, description="evaluate every N training steps (and after the last)")
    steps: int = Field(10, gt=0, description="batches per evaluation")
    dataset_path: str | None = Field(
        None, description="held-out shards; unset only with the embedded corpus (whose held-out split is used) "
                          "or with hf_dataset_name"
    )
    file_pattern: str = "*.npy"
    hf_dataset_name: str | None = Field(
        None, description="held-out rows of a Hugging Face dataset instead of dataset_path, tokenized once into the "
                          "Forge cache with the training data's tokenizer"
    )
    hf_dataset_config: str | None = Field(None, description="eval.hf_dataset_name's configuration (subset)")
    hf_dataset_split: str = Field("validation", description="eval.hf_dataset_name's held-out split")
    hf_dataset_revision: str | None = Field(None, description="eval.hf_dataset_name's Hub branch, tag or commit")
