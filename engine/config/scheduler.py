"""`[scheduler]`: the learning-rate schedule (multiplier on optimizer.lr).

`warmup_steps` and `decay_steps` are shared; the other fields belong to some schedules only
(`READ_BY`), and setting one away from its default while another schedule is chosen is a config error
(`JobConfig.validate`). `decay_steps` is exempt: the run directory records its resolved value for every
schedule, so that a resumed run keeps its schedule.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.config.base import Section

SchedulerName = Literal["cosine", "linear", "wsd", "constant", "rex", "none"]


class SchedulerConfig(Section):
    name: SchedulerName = Field("cosine", description="cosine, linear, wsd, constant, rex or none")
    warmup_steps: int = Field(0, ge=0, description="linear warmup from lr/(warmup_steps+1) to lr")
    decay_steps: int | None = Field(None, gt=0, description="length of the decay; unset = it ends on the last step")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="floor of the decay as a fraction of lr")
    stable_steps: int = Field(0, ge=0, description="wsd: steps at the peak lr between warmup and decay")
    wsd_decay_type: Literal["cosine", "linear", "sqrt"] = Field("cosine", description="wsd: shape of the decay")
    rex_alpha: float = Field(1.0, gt=0, description="rex: exponent on the REX profile; 1 = the paper's schedule")

    @model_validator(mode="after")
    def _none_has_no_warmup(self) -> SchedulerConfig:
        if self.name == "none" and self.warmup_steps:
            raise ValueError("scheduler 'none' keeps lr fixed and has no warmup; use name = 'constant' for warmup")
        return self


DECAYING = ("cosine", "linear", "wsd", "rex")
READ_BY: dict[str, tuple[str, ...]] = {
    "min_lr_ratio": DECAYING,
    "stable_steps": ("wsd",),
    "wsd_decay_type": ("wsd",),
    "rex_alpha": ("rex",),
}
"""Fields that only some schedules read, and which ones."""
