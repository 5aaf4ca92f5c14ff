"""AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization"), PyTorch's implementation."""

from __future__ import annotations

import torch
from torch import nn

from engine.config.optimizer import OptimizerConfig
from engine.config.registry import OPTIMIZERS
from engine.train.optim.groups import param_groups


def fused_supported(model: nn.Module) -> bool:
    """The fused AdamW kernel exists for CUDA and CPU floating-point parameters in the PyTorch we require."""
    return all(p.device.type in {"cuda", "cpu"} and p.is_floating_point() for p in model.parameters())


@OPTIMIZERS.register("adamw")
def adamw(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    fused = fused_supported(model) if cfg.fused is None else cfg.fused
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused
    )
