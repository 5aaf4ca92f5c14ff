"""`[eval]`: in-loop evaluation on held-out shards."""

from __future__ import annotations

from pydantic import Field

from engine.config.base import Section
from engine.config.data import HubDatasetFields


class EvalSchedule(Section):
    """The fields `[eval]` lists before its Hugging Face dataset fields."""

    enabled: bool = False
    interval: int = Field(100, gt=0, description="evaluate every N training steps (and after the last)")
    steps: int = Field(10, gt=0, description="batches per evaluation")
    dataset_path: str | None = Field(
        None,
        description="held-out shards; unset only with the embedded corpus (whose held-out split is used) "
        "or with hf_dataset_name",
    )
    file_pattern: str = "*.npy"


class EvalConfig(HubDatasetFields, EvalSchedule):
    hf_dataset_split: str = Field("validation", description="eval.hf_dataset_name's held-out split")
