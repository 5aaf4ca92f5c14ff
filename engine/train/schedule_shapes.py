"""The learning-rate schedules, one config class each (torch-free, pure Python): its own fields, its multiplier
after the warmup (`decay`), and its registration, one decorator. engine/train/schedules.py runs them (warmup,
stable phase, warm restarts, tokens or steps) and `[scheduler]` is composed of their fields
(engine/config/scheduler.py).

A new schedule is a class here: `@SCHEDULERS.register("NAME")` on a subclass of `SchedulerFields` (or of
`DecayFloor` for one that decays to `min_lr_ratio`) with the fields only it reads and its `decay`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

from pydantic import Field

from engine.config.registry import SCHEDULERS
from engine.config.scheduler import SchedulerFields


def above_floor(shape: float, floor: float) -> float:
    """A shape that falls from 1 to 0, lifted onto [floor, 1]."""
    return floor + (1 - floor) * shape


def cosine_shape(progress: float) -> float:
    return 0.5 * (1 + math.cos(math.pi * progress))


def linear_shape(progress: float) -> float:
    return 1 - progress


def sqrt_shape(progress: float) -> float:
    """1 - sqrt(p): the cooldown Hägele et al. (2024, "Scaling Laws and Compute-Optimal Training Beyond
    Fixed Training Durations") found best for WSD; it leaves the peak faster than linear."""
    return 1 - math.sqrt(progress)


def rex_shape(progress: float, alpha: float) -> float:
    """REX (Chen, Wolfe & Kyrillidis, MLSys 2022): (1 - p) / (1 - p/2), which decays slower than linear
    early and faster late; raised to `alpha` (1 = the paper's profile)."""
    return ((1 - progress) / (1 - progress / 2)) ** alpha


WSD_SHAPES: dict[str, Callable[[float], float]] = {"cosine": cosine_shape, "linear": linear_shape, "sqrt": sqrt_shape}


class ByProgress(SchedulerFields):
    """A schedule that falls over `decay_steps` by progress p = steps / decay_steps, then stays at p = 1."""

    def decay(self, steps: int, decay_steps: int) -> float:
        return self.shape(min(steps / decay_steps, 1.0))

    def shape(self, progress: float) -> float:
        raise NotImplementedError


class DecayFloor(ByProgress):
    """A schedule that decays from the peak to a floor."""

    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="floor of the decay as a fraction of lr; cosine, linear, wsd, rex"
    )


@SCHEDULERS.register("cosine")
class Cosine(DecayFloor):
    def shape(self, progress: float) -> float:
        return above_floor(cosine_shape(progress), self.min_lr_ratio)


@SCHEDULERS.register("linear")
class Linear(DecayFloor):
    def shape(self, progress: float) -> float:
        return above_floor(linear_shape(progress), self.min_lr_ratio)


@SCHEDULERS.register("wsd")
class WarmupStableDecay(DecayFloor):
    """Warmup-stable-decay (Hu et al. 2024, MiniCPM): the peak is held for stable_steps, then decays with the
    `wsd_decay_type` shape; a run can branch its decay from any stable checkpoint."""

    stable_steps: int = Field(
        0, ge=0, description="wsd only: steps at the peak lr between warmup and decay (> 0 needs decay_steps)"
    )
    wsd_decay_type: Literal["cosine", "linear", "sqrt"] = Field("cosine", description="wsd only: shape of the decay")

    @property
    def held_steps(self) -> int:
        return self.stable_steps

    def shape(self, progress: float) -> float:
        return above_floor(WSD_SHAPES[self.wsd_decay_type](progress), self.min_lr_ratio)


@SCHEDULERS.register("constant")
class Constant(ByProgress):
    def shape(self, progress: float) -> float:
        return 1.0


@SCHEDULERS.register("rex")
class Rex(DecayFloor):
    rex_alpha: float = Field(1.0, gt=0, description="rex only: exponent on the REX profile; 1 = the paper's schedule")

    def shape(self, progress: float) -> float:
        return above_floor(rex_shape(progress, self.rex_alpha), self.min_lr_ratio)


@SCHEDULERS.register("inv_sqrt")
class InverseSqrt(SchedulerFields):
    """Inverse square root (Vaswani et al. 2017): sqrt(T / (T + steps)) with T = max(warmup_steps, 1), so it
    leaves the peak at the rate the warmup reached it and never reaches a floor (decay_steps is not read)."""

    def check(self) -> None:
        if self.decay_steps is not None:
            raise ValueError("inv_sqrt decays by sqrt(warmup_steps / step) and has no decay_steps; remove it")

    def decay(self, steps: int, decay_steps: int) -> float:
        timescale = max(self.warmup_steps, 1)
        return math.sqrt(timescale / (timescale + steps))


@SCHEDULERS.register("none")
class NoSchedule(ByProgress):
    def check(self) -> None:
        if self.warmup_steps or self.rewarmup_steps:
            raise ValueError("scheduler 'none' keeps lr fixed and has no warmup; use name = 'constant' for warmup")

    def shape(self, progress: float) -> float:
        return 1.0
