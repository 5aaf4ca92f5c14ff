"""Checkpointing as a callback: saves on the checkpoint steps and when the run is preempted, reports saves
that finish in the background, and finishes the last one at the end. The saving itself (`save`, `finish`)
is also what the loop calls when a callback fails (engine/train/trainer.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.resilience.collectives import any_rank
from engine.train.callbacks.base import PRIORITY, Callback
from engine.train.job import train_state
from engine.train.rollback import roll_back, weights_finite

if TYPE_CHECKING:
    from engine.train.step import StepResult
    from engine.train.trainer import TrainLoop

log = logging.getLogger("forge.train")


class Checkpointing(Callback):
    name = "checkpointing"
    priority = PRIORITY["checkpointing"]
    failure_saves = False  # a checkpoint that cannot be written is the run's own error

    def after_optimizer_step(self, step: int, result: StepResult, loop: TrainLoop) -> None:
        written(loop, loop.job.checkpointer.poll())

    def on_checkpoint_due(self, step: int, loop: TrainLoop) -> None:
        if save(loop, step, loop.stopping):
            saved(loop, step)

    def on_preempted(self, step: int, loop: TrainLoop) -> None:
        """The emergency checkpoint (unless the step was just saved), finished before the run stops."""
        if not loop.job.checkpointer.has(step) and save(loop, step, True):
            saved(loop, step)
        finish(loop)

    def on_end(self, summary: dict[str, Any], loop: TrainLoop) -> None:
        finish(loop)


def save(loop: TrainLoop, step: int, preempted: bool) -> bool:
    """Save step `step` (due, or the run is stopping), never with non-finite weights; False when postponed."""
    job, progress = loop.job, loop.progress
    if any_rank(not weights_finite(job.model), job.device):  # never checkpoint non-finite weights
        log.error("step %d: non-finite weights; rolling back instead of saving them", step)
        with progress.window.pause():
            roll_back(job, step, "non-finite weights")
    if job.guard.consecutive_bad and step < job.cfg.train.max_steps and not preempted:
        # Skipped steps leave the weights as they were, so this checkpoint would repeat the last
        # good one and make the next rollback a no-op: wait for a good step.
        log.warning("step %d: checkpoint postponed during a run of bad steps", step)
        return False
    with progress.window.pause():
        state = train_state(job, step, progress.tokens_seen, progress.elapsed(), loop.callbacks.states())
        path = job.checkpointer.save(step, job.model, job.optimizer, state)  # None: finishes in the background
    if path is not None:
        written(loop, (step, path))
    return True


def saved(loop: TrainLoop, step: int) -> None:
    loop.callbacks.emit("on_checkpoint_saved", step, step, step_path(loop, step), loop)


def finish(loop: TrainLoop) -> None:
    """Wait for the save in flight, if any, and report it."""
    written(loop, loop.job.checkpointer.wait())


def written(loop: TrainLoop, done: tuple[int, Path] | None) -> None:
    if done is not None:
        loop.callbacks.emit("on_checkpoint_written", done[0], *done, loop)
        log.info("checkpoint %s", done[1])


def step_path(loop: TrainLoop, step: int) -> Path:
    return loop.job.checkpointer.root / f"step_{step}"
