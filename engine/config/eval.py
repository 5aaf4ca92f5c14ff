"""`[eval]`: in-loop evaluation: the loss on held-out shards, and downstream tasks through lm-evaluation-harness."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from engine.config.base import Section
from engine.data.kinds import HubDatasetFields


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
    tasks: list[str] = Field(
        default_factory=list,
        description="downstream tasks evaluated during training (with eval.enabled), as `forge eval --tasks` "
        "names them: lm-evaluation-harness names, Forge's own (forge_next_line), or task YAML files; logged as "
        "eval/TASK/METRIC; needs the [eval] extra; no held-out shards needed",
    )
    task_interval: int | None = Field(
        None, gt=0, description="evaluate eval.tasks every N training steps (and after the last); unset: eval.interval"
    )
    task_limit: int | None = Field(None, gt=0, description="the first N documents of each task only; unset: all")
    task_num_fewshot: int | None = Field(
        None, ge=0, description="examples in each task prompt; unset: each task's own (usually 0)"
    )
    task_batch_size: int = Field(8, gt=0, description="rows per forward when evaluating eval.tasks (as forge eval's)")
