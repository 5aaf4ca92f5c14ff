"""`[scheduler]`: the learning-rate schedule (multiplier on optimizer.lr)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.config.base import Section


class SchedulerConfig(Section):
    name: Literal["cosine", "linear", "constant", "none"] = "cosine"
    warmup_steps: int = Field(0, ge=0, description="linear warmup from lr/(warmup_steps+1) to lr")
    decay_steps: int | None = Field(None, gt=0, description="length of the decay; unset = it ends on the last step")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="floor of the decay as a fraction of lr")

    @model_validator(mode="after")
    def _none_has_no_warmup(self) -> "SchedulerConfig":
        if self.name == "none" and self.warmup_steps:
            raise ValueError("scheduler 'none' keeps lr fixed and has no warmup; use name = 'constant' for warmup")
        return self
