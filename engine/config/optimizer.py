"""`[optimizer]`: which optimizer and its hyperparameters.

`lr`, `weight_decay` and `betas` are shared; the other fields belong to some optimizers only
(`READ_BY`), and setting one away from its default while another optimizer is chosen is a config error
(`JobConfig.validate`), so no field is silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from engine.config.base import Section

Beta = Annotated[float, Field(ge=0, lt=1)]
OptimizerName = Literal["adamw", "lion", "muon", "schedule_free_adamw"]


class OptimizerConfig(Section):
    name: OptimizerName = Field("adamw", description="adamw, lion, muon or schedule_free_adamw")
    lr: float = Field(3e-4, gt=0, description="peak learning rate (muon: of the hidden matrices)")
    weight_decay: float = Field(0.1, ge=0, description="decoupled decay on matrices (not norms, biases, embeddings)")
    betas: tuple[Beta, Beta] = Field(
        (0.9, 0.95), description="AdamW moment decay rates, each in [0, 1); lion: (interpolation, momentum) decay"
    )
    eps: float = Field(1e-8, gt=0, description="added to Adam's denominator (not read by lion)")
    fused: bool | None = Field(
        None, description="fused AdamW kernel (adamw only); unset = use it where the device supports it"
    )
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="muon: Nesterov momentum of the hidden matrices")
    muon_ns_steps: int = Field(5, ge=1, le=20, description="muon: Newton–Schulz iterations per orthogonalization")
    muon_adam_lr: float | None = Field(
        None, gt=0, description="muon: peak lr of the AdamW fallback (embeddings, head, norms); unset = lr"
    )
    schedule_free_warmup_steps: int = Field(
        0, ge=0, description="schedule_free_adamw: linear warmup inside the optimizer, lr·(k+1)/N for step k < N"
    )


ADAM_FAMILY = ("adamw", "muon", "schedule_free_adamw")
READ_BY: dict[str, tuple[str, ...]] = {
    "eps": ADAM_FAMILY,
    "fused": ("adamw",),
    "muon_momentum": ("muon",),
    "muon_ns_steps": ("muon",),
    "muon_adam_lr": ("muon",),
    "schedule_free_warmup_steps": ("schedule_free_adamw",),
}
"""Fields that only some optimizers read, and which ones."""
