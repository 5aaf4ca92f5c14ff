"""eval.tasks during training (engine.eval.in_training) as a callback, at eval.task_interval."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine.eval.in_training import TrainingTasks
from engine.train.callbacks.base import PRIORITY, Callback
from engine.train.optim import eval_mode

if TYPE_CHECKING:
    from engine.train.step import StepResult
    from engine.train.trainer import TrainLoop

log = logging.getLogger("forge.train")


class InLoopTasks(Callback):
    """The tasks at the weights the optimizer evaluates, logged as kind "tasks", keys eval/TASK/METRIC. At
    their own cadence, after the step's held-out evaluation."""

    name = "tasks"
    priority = PRIORITY["tasks"]
    failure_saves = False

    def __init__(self, tasks: TrainingTasks) -> None:
        self.tasks = tasks

    def after_step(self, step: int, result: StepResult, loop: TrainLoop) -> None:
        job = loop.job
        if not self.tasks.due(step, job.cfg.train.max_steps):
            return
        with loop.progress.window.pause(), eval_mode(job.optimizer):
            metrics = self.tasks.evaluate(job.model, job.device)
        loop.log(step, metrics, "tasks")
        log.info("tasks step %d %s", step, " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
