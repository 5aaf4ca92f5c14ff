"""The periodic merge of LoRA adapters (lora.merge_interval) as a callback, after the update."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine.train.callbacks.base import PRIORITY, Callback
from engine.train.lora_merge import merge_adapters

if TYPE_CHECKING:
    from engine.train.step import StepResult
    from engine.train.trainer import TrainLoop

log = logging.getLogger("forge.train")


class LoraMerge(Callback):
    """Every `interval` steps, fold the adapters into the base and restart them (the model computes the
    same function before and after). The generator of the new A is seeded by the step, so a resumed run
    merges exactly as the first attempt."""

    name = "lora_merge"
    priority = PRIORITY["lora_merge"]
    failure_saves = False

    def __init__(self, interval: int) -> None:
        self.interval = interval

    def after_optimizer_step(self, step: int, result: StepResult, loop: TrainLoop) -> None:
        if step % self.interval:
            return
        job = loop.job
        job.checkpointer.wait_for_staging()  # a background save must hold its copy before the weights change
        merged = merge_adapters(job.model, job.cfg.lora, job.cfg.train.seed + step, job.optimizer)
        log.info("step %d: merged %d LoRA adapters into the base weights", step, merged)
