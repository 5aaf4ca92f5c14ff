"""Learning-rate schedules as multipliers of `optimizer.lr`, driven by `torch.optim.lr_scheduler.LambdaLR`.

Step s counts optimizer steps from 0. Warmup (when warmup_steps = W > 0) is linear: (s + 1) / (W + 1),
so the first step already trains (at lr / (W + 1)) and step W - 1 reaches W / (W + 1). `wsd` then holds
the peak for `stable_steps` = S steps (the other schedules have S = 0). The decay then runs over
`decay_steps` = D from 1 down to `min_lr_ratio` = m, as m + (1 - m) · shape(p) with progress
p = (s - W - S) / D, and stays at the floor after. By default D = max_steps - W - S - 1, so the last step
(s = max_steps - 1) trains exactly at the floor.

The multipliers are plain Python (no torch), so `forge validate-config` can draw the curve without
importing torch; only `build_scheduler` touches torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.config.registry import SCHEDULERS
from engine.config.scheduler import SchedulerConfig

if TYPE_CHECKING:
    import torch

    from engine.config.job import JobConfig

Decay = Callable[[float, SchedulerConfig], float]  # (progress in [0, 1], config) -> multiplier


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


@SCHEDULERS.register("cosine")
def cosine(progress: float, cfg: SchedulerConfig) -> float:
    return above_floor(cosine_shape(progress), cfg.min_lr_ratio)


@SCHEDULERS.register("linear")
def linear(progress: float, cfg: SchedulerConfig) -> float:
    return above_floor(linear_shape(progress), cfg.min_lr_ratio)


@SCHEDULERS.register("wsd")
def warmup_stable_decay(progress: float, cfg: SchedulerConfig) -> float:
    """Warmup-stable-decay (Hu et al. 2024, MiniCPM): the peak is held for stable_steps (in `lr_multiplier`),
    then decays with the `wsd_decay_type` shape; a run can branch its decay from any stable checkpoint."""
    return above_floor(WSD_SHAPES[cfg.wsd_decay_type](progress), cfg.min_lr_ratio)


@SCHEDULERS.register("rex")
def rex(progress: float, cfg: SchedulerConfig) -> float:
    return above_floor(rex_shape(progress, cfg.rex_alpha), cfg.min_lr_ratio)


@SCHEDULERS.register("constant")
def constant(progress: float, cfg: SchedulerConfig) -> float:
    return 1.0


@SCHEDULERS.register("none")
def no_schedule(progress: float, cfg: SchedulerConfig) -> float:
    return 1.0


def stable_steps(cfg: SchedulerConfig) -> int:
    return cfg.stable_steps if cfg.name == "wsd" else 0


def default_decay_steps(cfg: SchedulerConfig, max_steps: int) -> int:
    """The decay that ends on the last step: max_steps - warmup - stable - 1 (at least 1)."""
    return max(max_steps - cfg.warmup_steps - stable_steps(cfg) - 1, 1)


def lr_multiplier(cfg: SchedulerConfig, max_steps: int) -> Callable[[int], float]:
    decay: Decay = SCHEDULERS.get(cfg.name)
    warmup, hold = cfg.warmup_steps, stable_steps(cfg)
    decay_steps = cfg.decay_steps or default_decay_steps(cfg, max_steps)

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if step < warmup + hold:
            return 1.0
        return decay(min((step - warmup - hold) / decay_steps, 1.0), cfg)

    return multiplier


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    import torch  # here, not at the top: validate-config imports this module and must not load torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(cfg, max_steps))


def schedule_free_warmup(steps: int, step: int) -> float:
    """Schedule-free AdamW's own warmup (its reference implementation's form): (k + 1) / N for k < N."""
    return min((step + 1) / steps, 1.0) if steps else 1.0


def learning_rate(cfg: JobConfig, step: int) -> float:
    """The peak learning rate (`optimizer.lr` times every multiplier) that 0-based `step` trains with."""
    multiplier = lr_multiplier(cfg.scheduler, cfg.train.max_steps)(step)
    if cfg.optimizer.name == "schedule_free_adamw":
        multiplier *= schedule_free_warmup(cfg.optimizer.schedule_free_warmup_steps, step)
    return cfg.optimizer.lr * multiplier


def key_steps(cfg: JobConfig) -> list[int]:
    """The 0-based steps where the schedule changes phase: first, end of warmup, end of stable, floor, last."""
    s, last = cfg.scheduler, cfg.train.max_steps - 1
    peak = s.warmup_steps + stable_steps(s)
    marks = {0, s.warmup_steps - 1, s.warmup_steps, peak, last}
    if s.name not in ("constant", "none"):
        marks.add(peak + (s.decay_steps or default_decay_steps(s, cfg.train.max_steps)))
    if cfg.optimizer.name == "schedule_free_adamw":
        marks.add(cfg.optimizer.schedule_free_warmup_steps - 1)
    return sorted(m for m in marks if 0 <= m <= last)
