"""`[eval]`: in-loop evaluation on held-out shards."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from engine.config.base import Section
from engine.config.data import HubDatasetFields


class EvalSchedule(Section):
    """The fields `[eval]` lists before its Hugging Face dataset fields."""

    enabled: bool = Field(False, description="evaluate on held-out data during training")
    interval: int = Field(100, gt=0, description="evaluate every N training steps (and after the last)")
    steps: Annotated[int, Field(gt=0)] | Literal["all"] = Field(
        10,
        description='batches per evaluation; "all" = every window of the held-out set once, shared out over '
        "the data-parallel ranks (a token-weighted mean, the same as one process)",
    )
    dataset_path: str | None = Field(
        None,
        description="held-out shards: a folder, a URL (fetched once into the Forge cache) or embedded:SPLIT "
        "(embedded:val: the corpus's held-out works); unset only with the embedded corpus (whose held-out split "
        "is used) or with hf_dataset_name. Also spelled path, and each hf_dataset_* field hf_*",
    )
    file_pattern: str = Field("*.npy", description="glob of shard files inside dataset_path")


class EvalConfig(HubDatasetFields, EvalSchedule):
    hf_dataset_split: str = Field("validation", description="eval.hf_dataset_name's held-out split")

    readers: ClassVar[dict[str, str]] = {
        "enabled": "data/loader.py",
        "interval": "train/trainer.py",
        "steps": "train/step.py, data/sampler.py",
        "dataset_path": "data/source_kinds.py",
        "file_pattern": "data/loader.py",
        "hf_dataset_name": "data/source_kinds.py",
        "hf_dataset_config": "data/source_kinds.py",
        "hf_dataset_split": "data/source_kinds.py",
        "hf_dataset_revision": "data/source_kinds.py",
    }
    """The engine modules (under engine/) that read each field: the "read by" column of docs/configuration.md."""
