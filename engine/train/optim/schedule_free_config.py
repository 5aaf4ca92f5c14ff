"""Schedule-free AdamW's config (torch-free): its own field, its state size, and its registration
(engine/train/optim/schedule_free.py builds it)."""

from __future__ import annotations

from pydantic import Field

from engine.config.optimizer import FP32, AdamEps, OptimizerState
from engine.config.registry import OPTIMIZERS


@OPTIMIZERS.register("schedule_free_adamw", build="engine.train.optim.schedule_free:schedule_free_adamw")
class ScheduleFreeConfig(AdamEps):
    schedule_free_warmup_steps: int = Field(
        0, ge=0, description="schedule_free_adamw only: its own linear warmup, lr · (k+1)/N for step k < N"
    )

    def state(self) -> OptimizerState:
        return OptimizerState(2 * FP32)  # z and exp_avg_sq
