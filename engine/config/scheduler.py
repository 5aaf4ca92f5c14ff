"""`[scheduler]`: the learning-rate schedule (multiplier on optimizer.lr).

`warmup_steps` and `decay_steps` are shared; the other fields belong to some schedules only
(`READ_BY`), and setting one away from its default while another schedule is chosen is a config error
(`JobConfig.validate`). `decay_steps` is exempt: the run directory records its resolved value for every
schedule, so that a resumed run keeps its schedule.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from engine.config.base import Section

SchedulerName = Literal["cosine", "linear", "wsd", "constant", "rex", "inv_sqrt", "none"]


class SchedulerConfig(Section):
    name: SchedulerName = Field("cosine", description="the schedule: a multiplier on optimizer.lr over the steps")
    unit: Literal["steps", "tokens"] = Field(
        "steps",
        description="what warmup_steps, stable_steps, decay_steps and rewarmup_steps count, and where the "
        "schedule is read: optimizer steps done, or tokens trained on before the step (for batch ramps)",
    )
    warmup_steps: int = Field(0, ge=0, description="linear warmup from lr/(warmup_steps+1) to lr")
    decay_steps: int | None = Field(
        None,
        gt=0,
        description="length of the decay; unset = it ends on the last step "
        "(max_steps - warmup_steps - stable_steps - 1); the run directory records the resolved value",
    )
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="floor of the decay as a fraction of lr; cosine, linear, wsd, rex"
    )
    stable_steps: int = Field(
        0, ge=0, description="wsd only: steps at the peak lr between warmup and decay (> 0 needs decay_steps)"
    )
    wsd_decay_type: Literal["cosine", "linear", "sqrt"] = Field("cosine", description="wsd only: shape of the decay")
    rex_alpha: float = Field(1.0, gt=0, description="rex only: exponent on the REX profile; 1 = the paper's schedule")
    cycles: int | list[int] | None = Field(
        None,
        description="warm restarts: a number of equal cycles, or the steps after which a new cycle begins "
        "(strictly increasing, below max_steps); each cycle warms up again and runs the whole schedule over "
        "its own length; unset = one cycle",
    )
    rewarmup_steps: int | None = Field(
        None, ge=0, description="with cycles: warmup of every cycle after the first; unset = warmup_steps"
    )

    readers: ClassVar[dict[str, str]] = {
        "name": "train/schedules.py",
        "unit": "train/schedules.py",
        "warmup_steps": "train/schedules.py",
        "decay_steps": "train/schedules.py",
        "min_lr_ratio": "train/schedules.py",
        "stable_steps": "train/schedules.py",
        "wsd_decay_type": "train/schedules.py",
        "rex_alpha": "train/schedules.py",
        "cycles": "train/schedules.py",
        "rewarmup_steps": "train/schedules.py",
    }
    """The engine modules (under engine/) that read each field: the "read by" column of docs/configuration.md."""

    @model_validator(mode="after")
    def _none_has_no_warmup(self) -> SchedulerConfig:
        if self.name == "none" and (self.warmup_steps or self.rewarmup_steps):
            raise ValueError("scheduler 'none' keeps lr fixed and has no warmup; use name = 'constant' for warmup")
        return self

    @field_validator("cycles")
    @classmethod
    def _cycles_are_ordered(cls, cycles: int | list[int] | None) -> int | list[int] | None:
        if isinstance(cycles, int) and cycles < 1:
            raise ValueError(f"a number of cycles must be at least 1, got {cycles}")
        if isinstance(cycles, list) and not all(a < b for a, b in zip([0, *cycles], cycles)):
            raise ValueError(f"step boundaries must be above 0 and strictly increasing, got {cycles}")
        return cycles

    @model_validator(mode="after")
    def _inv_sqrt_has_no_decay_length(self) -> SchedulerConfig:
        if self.name == "inv_sqrt" and self.decay_steps is not None:
            raise ValueError("inv_sqrt decays by sqrt(warmup_steps / step) and has no decay_steps; remove it")
        return self

    @model_validator(mode="after")
    def _rewarmup_needs_cycles(self) -> SchedulerConfig:
        if self.rewarmup_steps is not None and self.cycles is None:
            raise ValueError("rewarmup_steps is the warmup of every cycle after the first; it needs cycles")
        return self


DECAYING = ("cosine", "linear", "wsd", "rex")
READ_BY: dict[str, tuple[str, ...]] = {
    "min_lr_ratio": DECAYING,
    "stable_steps": ("wsd",),
    "wsd_decay_type": ("wsd",),
    "rex_alpha": ("rex",),
}
"""Fields that only some schedules read, and which ones."""
