"""`[checkpoint]`: where, how often and how DCP checkpoints are written, and what a new run starts from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.config.base import Section


class CheckpointConfig(Section):
    dir: str = Field("checkpoints", description="checkpoint folder; relative paths are inside the run directory")
    interval: int | None = Field(None, gt=0, description="save every N steps; a final checkpoint is always written")
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = Field(
        "disabled",
        description="disabled = the loop waits for the save; async = it waits only for a copy of the state, "
        "the write runs in the background; async_with_pinned_mem = the copy also overlaps the next "
        "step's forward and backward (into pinned memory on a GPU)",
    )
    keep_last_n: int | None = Field(None, gt=0, description="delete older step_N checkpoints; unset = keep all")
    load_path: str | None = Field(
        None, description="a new run starts from these weights: a step_N folder or a checkpoint folder (its newest)"
    )
    exclude_from_loading: list[str] = Field(
        default_factory=list, description="parameter-name prefixes re-initialised instead of loaded from load_path"
    )

    @model_validator(mode="after")
    def _exclusions_need_a_source(self) -> CheckpointConfig:
        if self.exclude_from_loading and self.load_path is None:
            raise ValueError("exclude_from_loading applies to checkpoint.load_path, which is not set")
        return self
