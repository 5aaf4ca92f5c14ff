"""`[scheduler]`: the learning-rate schedule (multiplier on optimizer.lr).

`name`, `unit`, `warmup_steps`, `decay_steps`, `cycles` and `rewarmup_steps` are every schedule's
(`SchedulerFields`); each schedule's own fields, and its multiplier, are declared by its config class in
engine/train/schedule_shapes.py (registered in `SCHEDULERS`), and `SchedulerConfig`, the `[scheduler]` table, is
composed of them all (engine/config/registry.py: `ComponentRegistry`). A field set away from its default while
another schedule is chosen is a config error naming the schedules that read it (`JobConfig.validate`).
`decay_steps` is shared: the run directory records its resolved value for every schedule, so that a resumed run
keeps its schedule.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from engine.config.base import Section
from engine.config.registry import SCHEDULERS


class SchedulerFields(Section):
    """The fields every schedule reads; a schedule's config class derives from it (or from a mixin that does)."""

    name: str = Field("cosine", description="the schedule: a multiplier on optimizer.lr over the steps")
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
    cycles: int | list[int] | None = Field(
        None,
        description="warm restarts: a number of equal cycles, or the steps after which a new cycle begins "
        "(strictly increasing, below max_steps); each cycle warms up again and runs the whole schedule over "
        "its own length; unset = one cycle",
    )
    rewarmup_steps: int | None = Field(
        None, ge=0, description="with cycles: warmup of every cycle after the first; unset = warmup_steps"
    )

    @field_validator("cycles")
    @classmethod
    def _cycles_are_ordered(cls, cycles: int | list[int] | None) -> int | list[int] | None:
        if isinstance(cycles, int) and cycles < 1:
            raise ValueError(f"a number of cycles must be at least 1, got {cycles}")
        if isinstance(cycles, list) and not all(a < b for a, b in zip([0, *cycles], cycles)):
            raise ValueError(f"step boundaries must be above 0 and strictly increasing, got {cycles}")
        return cycles

    def check(self) -> None:
        """A schedule's own checks of the values it is given (raise ValueError); none by default."""

    def decay(self, steps: int, decay_steps: int) -> float:
        """The multiplier `steps` after the peak began to fall (after warmup and any stable phase)."""
        raise NotImplementedError(f"schedule {self.name!r} has no decay")

    @property
    def held_steps(self) -> int:
        """Steps at the peak between warmup and decay (wsd's stable phase); 0 for most schedules."""
        return 0


class SchedulerConfig(SchedulerFields):
    """The `[scheduler]` table: the shared fields and every registered schedule's own ones (composed by
    `SCHEDULERS.bind` below; the chosen schedule's own config is `SCHEDULERS.chosen(cfg)`)."""

    @model_validator(mode="after")
    def _chosen_schedule_checks(self) -> SchedulerConfig:
        if self.name in SCHEDULERS.names():
            SCHEDULERS.chosen(self).check()
        return self

    @model_validator(mode="after")
    def _rewarmup_needs_cycles(self) -> SchedulerConfig:
        if self.rewarmup_steps is not None and self.cycles is None:
            raise ValueError("rewarmup_steps is the warmup of every cycle after the first; it needs cycles")
        return self


import engine.train.schedule_shapes  # noqa: E402, F401  (registers every schedule's config: torch-free)

SCHEDULERS.bind(SchedulerConfig, SchedulerFields, tail=("cycles", "rewarmup_steps"))
