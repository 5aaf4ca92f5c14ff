"""`[optimizer]`: which optimizer and its hyperparameters."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from engine.config.base import Section


Beta = Annotated[float, Field(ge=0, lt=1)]


class OptimizerConfig(Section):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(3e-4, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.1, ge=0, description="decoupled decay on matrices (not norms, biases, embeddings)")
    betas: tuple[Beta, Beta] = Field((0.9, 0.95), description="AdamW moment decay rates, each in [0, 1)")
    eps: float = Field(1e-8, gt=0)
    fused: bool | None = Field(None, description="fused AdamW kernel; unset = use it where the device supports it")
