"""Rolling back to the last checkpoint: after too many bad steps in a row, or instead of saving non-finite
weights (engine/train/callbacks/checkpointing.py)."""

from __future__ import annotations

import logging

import torch
from torch.distributed.tensor import DTensor

from engine.resilience.anomaly import TrainingDiverged
from engine.train.job import Job

log = logging.getLogger("forge.train")


def weights_finite(model: torch.nn.Module) -> bool:
    """This rank's shards only: callers agree over ranks. Only the parameters that train can have become
    non-finite (a frozen LoRA base, possibly NF4, is as loaded)."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters() if p.requires_grad]
    return bool(torch.stack([p.detach().isfinite().all() for p in local]).all())


def roll_back(job: Job, step: int, reason: str) -> None:
    """Reload the last checkpoint's weights and optimizer state and go on with the next batches. The LR
    schedule keeps its place (the optimizer's restored LR is put back)."""
    lrs = [group["lr"] for group in job.optimizer.param_groups]
    if job.guard.rollbacks >= job.cfg.train.max_rollbacks:
        job.guard.rolled_back(reason, None)  # raises TrainingDiverged
    restored = job.checkpointer.rollback(job.model, job.optimizer)
    if restored is None:
        raise TrainingDiverged(
            f"{reason} at step {step}, before the first checkpoint, so there is nothing to "
            "roll back to; lower optimizer.lr or check the data"
        )
    job.guard.rolled_back(reason, restored[1])
    if job.ema is not None:
        job.ema.after_load(restored[1])
    job.refresh_float8_scales()
    for group, lr in zip(job.optimizer.param_groups, lrs):
        group["lr"] = lr
    log.warning(
        "step %d: %s; rolled back to %s (rollback %d of at most %d)",
        step,
        reason,
        restored[0],
        job.guard.rollbacks,
        job.cfg.train.max_rollbacks,
    )
