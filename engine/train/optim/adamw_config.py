"""AdamW's config (torch-free): its own fields, its state size, and its registration (engine/train/optim/adamw.py
builds it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config.optimizer import BF16, EIGHT_BIT, FP32, AdamEps, OptimizerState
from engine.config.registry import OPTIMIZERS

StateDtype = Literal["fp32", "bf16", "int8"]
WeightDtype = Literal["fp32", "bf16"]

FP32_STATE = OptimizerState(2 * FP32, bytes_per_tensor=FP32)
"""exp_avg and exp_avg_sq, and the scalar `step` tensor."""
TORCHAO_STATES: dict[tuple[str, str], OptimizerState] = {
    # (weight_dtype, state_dtype) → torchao's AdamW8bit / AdamW: exp_avg and exp_avg_sq, quantized or in the
    # weights' dtype (torchao makes unquantized moments like the parameter), and an fp32 `step` tensor.
    ("fp32", "int8"): OptimizerState(2 * FP32, bytes_per_tensor=FP32, quantized=EIGHT_BIT),
    ("bf16", "int8"): OptimizerState(2 * BF16, bytes_per_tensor=FP32, quantized=EIGHT_BIT),
    ("bf16", "bf16"): OptimizerState(2 * BF16, bytes_per_tensor=FP32),
}
"""AdamW's state by `optimizer.weight_dtype` and `state_dtype`, where it is not the fp32 one."""


@OPTIMIZERS.register("adamw", build="engine.train.optim.adamw:adamw")
class AdamWConfig(AdamEps):
    fused: bool | None = Field(
        None, description="adamw only: fused AdamW kernel; unset = use it where the device supports it"
    )
    state_dtype: StateDtype = Field(
        "fp32",
        description="adamw only: its moments' storage; int8 = torchao's AdamW8bit (block-wise 8-bit moments "
        "of the blocks' matrices, ~2 bytes a parameter instead of 8; embedding and head keep fp32; update in fp32); "
        "bf16 = torchao's AdamW with bf16 moments, only with weight_dtype = bf16 (docs/training.md#memory-options)",
    )
    weight_dtype: WeightDtype = Field(
        "fp32",
        description="adamw only: the trained weights' dtype; bf16 = weights and gradients in bf16, each "
        "update computed in fp32 and stochastically rounded to bf16 (torchao), with state_dtype bf16 or int8",
    )

    def state(self) -> OptimizerState:
        return TORCHAO_STATES.get((self.weight_dtype, self.state_dtype), FP32_STATE)

    def weight_bytes(self) -> int:
        return BF16 if self.weight_dtype == "bf16" else FP32
