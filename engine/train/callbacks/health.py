"""The collective health check (train.nccl_health_check_interval) as a callback."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.resilience.health import check_collectives
from engine.train.callbacks.base import PRIORITY, Callback

if TYPE_CHECKING:
    from engine.train.step import StepResult
    from engine.train.trainer import TrainLoop


class CollectiveHealth(Callback):
    """Every `interval` steps every rank answers on a gloo group of its own, or the run stops with
    `CollectiveTimeout` naming who did not (engine.resilience.health). Multi-process runs only."""

    name = "health"
    priority = PRIORITY["health"]
    failure_saves = False

    def __init__(self, interval: int, timeout_sec: float) -> None:
        self.interval, self.timeout_sec = interval, timeout_sec
        self.monitor: torch.distributed.ProcessGroup | None = None

    def on_start(self, loop: TrainLoop) -> None:
        self.monitor = torch.distributed.new_group(backend="gloo")  # every rank, at the same point

    def after_step(self, step: int, result: StepResult, loop: TrainLoop) -> None:
        if step % self.interval == 0:
            check_collectives(self.timeout_sec, loop.job.device, self.monitor)
