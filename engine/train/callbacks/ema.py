"""The EMA of the weights (train.ema_decay, engine/train/ema.py) as a callback: it folds in each applied step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.train.callbacks.base import PRIORITY, Callback
from engine.train.ema import WeightAverage

if TYPE_CHECKING:
    from engine.train.step import StepResult
    from engine.train.trainer import TrainLoop


class EmaUpdate(Callback):
    """After every applied step, before anything else changes the weights (a LoRA merge); a skipped step
    changes neither the weights nor the EMA. The average itself is saved with the weights (a DCP entry, not
    train state) and swapped in by the evaluation."""

    name = "ema"
    priority = PRIORITY["ema"]
    failure_saves = False

    def __init__(self, average: WeightAverage) -> None:
        self.average = average

    def after_optimizer_step(self, step: int, result: StepResult, loop: TrainLoop) -> None:
        if result.problem is None:
            self.average.update(step)
