"""Learning-rate schedules as multipliers of `optimizer.lr`, driven by `torch.optim.lr_scheduler.LambdaLR`.

Step s counts optimizer steps from 0. Warmup (when warmup_steps = W > 0) is linear: (s + 1) / (W + 1),
so the first step already trains (at lr / (W + 1)) and step W - 1 reaches W / (W + 1). After warmup the
decay runs over `decay_steps` from 1 down to `min_lr_ratio`, then stays there. By default decay_steps is
max_steps - W - 1, so the last step (s = max_steps - 1) trains exactly at the floor.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from engine.config.registry import SCHEDULERS
from engine.config.scheduler import SchedulerConfig

Decay = Callable[[float, float], float]  # (progress in [0, 1], min_lr_ratio) -> multiplier


@SCHEDULERS.register("cosine")
def cosine(progress: float, floor: float) -> float:
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@SCHEDULERS.register("linear")
def linear(progress: float, floor: float) -> float:
    return 1 - (1 - floor) * progress


@SCHEDULERS.register("constant")
def constant(progress: float, floor: float) -> float:
    return 1.0


@SCHEDULERS.register("none")
def no_schedule(progress: float, floor: float) -> float:
    return 1.0


def lr_multiplier(cfg: SchedulerConfig, max_steps: int) -> Callable[[int], float]:
    decay: Decay = SCHEDULERS.get(cfg.name)
    warmup = cfg.warmup_steps
    decay_steps = cfg.decay_steps or max(max_steps - warmup - 1, 1)

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return decay(min((step - warmup) / decay_steps, 1.0), cfg.min_lr_ratio)

    return multiplier


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(cfg, max_steps))
