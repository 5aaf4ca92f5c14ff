"""The held-out evaluation (eval.interval, and after the last step) as a callback."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine.train.callbacks.base import PRIORITY, Callback
from engine.train.step import evaluate

if TYPE_CHECKING:
    from engine.train.trainer import TrainLoop

log = logging.getLogger("forge.train")


class HeldOutEval(Callback):
    """The loss on the held-out batches (and at the EMA's weights), logged as kind "eval"; its time does
    not count against tokens/s."""

    name = "eval"
    priority = PRIORITY["eval"]
    failure_saves = False

    def on_eval_due(self, step: int, loop: TrainLoop) -> None:
        with loop.progress.window.pause():
            metrics = evaluate(loop.job, loop.loss_fn)
        loop.log(step, metrics, "eval")
        log.info("eval step %d loss %.4f", step, metrics["eval_loss"])
