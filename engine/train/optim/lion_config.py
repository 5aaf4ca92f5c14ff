"""Lion's config (torch-free): the shared fields only, its state size, and its registration
(engine/train/optim/lion.py builds it)."""

from __future__ import annotations

from engine.config.optimizer import FP32, OptimizerFields, OptimizerState
from engine.config.registry import OPTIMIZERS


@OPTIMIZERS.register("lion", build="engine.train.optim.lion:lion")
class LionConfig(OptimizerFields):
    def state(self) -> OptimizerState:
        return OptimizerState(FP32)  # exp_avg
