"""`[checkpoint]`: where, how often and how DCP checkpoints are written, and what a new run starts from."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from engine.config.base import Section


class KeepRule(Section):
    """Checkpoints at multiples of `every`, up to step `until` (unset: the whole run), are never deleted."""

    every: int = Field(gt=0, description="keep the checkpoints of steps that are multiples of this")
    until: int | None = Field(None, gt=0, description="only up to this step; unset = the whole run")

    def keeps(self, step: int) -> bool:
        return step % self.every == 0 and (self.until is None or step <= self.until)


class CheckpointConfig(Section):
    dir: str = Field(
        "checkpoints",
        description="checkpoint folder: relative, inside the run directory (one leading out is refused); absolute, a "
        "folder of this run's own (locked with it)",
    )
    interval: int | None = Field(None, gt=0, description="save every N steps; a final checkpoint is always written")
    interval_minutes: float | None = Field(
        None,
        gt=0,
        description="also save when this many minutes of wall time have passed since the last save (or the "
        "start), whichever of this and interval comes first; all ranks save at the same step",
    )
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = Field(
        "disabled",
        description="disabled = the loop waits for the save; async = it waits only while the state is copied, the "
        "files are written in the background; async_with_pinned_mem = the copy too runs in the "
        "background, overlapping the next step's forward and backward (into pinned memory on a GPU)",
    )
    keep_last_n: int | None = Field(None, gt=0, description="delete older step_N checkpoints; unset = keep all")
    keep: list[KeepRule] = Field(
        default_factory=list,
        description="checkpoints keep_last_n never deletes: rules {every = N, until = STEP}, each keeping the steps "
        "that are multiples of N, up to STEP (no until = the whole run); e.g. [{every = 10000}]",
    )
    load_path: str | None = Field(
        None,
        description="a new run starts from these weights (not their optimizer state, schedule or step): a "
        "step_N folder, a checkpoint folder or a run directory (its newest complete "
        "checkpoint). A run resuming from its own checkpoint ignores it",
    )
    export_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="the weight dtype `forge convert to-hf` writes for this run when its --dtype is not given",
    )
    exclude_from_loading: list[str] = Field(
        default_factory=list,
        description="parameter-name prefixes (e.g. 'output.') that keep their fresh "
        "initialisation instead of being loaded from load_path",
    )

    readers: ClassVar[dict[str, str]] = {
        "dir": "train/job.py, checkpoint/locate.py",
        "interval": "checkpoint/manager.py",
        "interval_minutes": "checkpoint/manager.py",
        "async_mode": "checkpoint/manager.py",
        "keep_last_n": "checkpoint/manager.py",
        "keep": "checkpoint/manager.py",
        "load_path": "train/job.py, checkpoint/manager.py",
        "export_dtype": "checkpoint/locate.py, checkpoint/hf.py",
        "exclude_from_loading": "train/job.py, checkpoint/manager.py",
    }
    """The engine modules (under engine/) that read each field: the "read by" column of docs/configuration.md."""

    @model_validator(mode="after")
    def _exclusions_need_a_source(self) -> CheckpointConfig:
        if self.exclude_from_loading and self.load_path is None:
            raise ValueError("exclude_from_loading applies to checkpoint.load_path, which is not set")
        return self

    @model_validator(mode="after")
    def _keep_rules_need_rotation(self) -> CheckpointConfig:
        if self.keep and self.keep_last_n is None:
            raise ValueError("checkpoint.keep protects checkpoints from keep_last_n's rotation, which is not set")
        return self

    def kept(self, step: int) -> bool:
        """Whether a `keep` rule protects step `step`'s checkpoint from deletion."""
        return any(rule.keeps(step) for rule in self.keep)
