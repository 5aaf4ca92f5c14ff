"""AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization"): PyTorch's implementation, or with
`optimizer.state_dtype = "int8"` torchao's `AdamW8bit` (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization"), whose moments are stored as block-wise 8-bit codes and whose update is computed in fp32."""

from __future__ import annotations

import torch
from torch import nn

from engine.config.optimizer import OptimizerConfig
from engine.config.registry import OPTIMIZERS
from engine.parallel.float8 import quiet_torchao_import
from engine.train.optim.groups import param_groups


def fused_supported(model: nn.Module) -> bool:
    """The fused AdamW kernel exists for CUDA and CPU floating-point parameters in the PyTorch we require."""
    return all(p.device.type in {"cuda", "cpu"} and p.is_floating_point() for p in model.parameters())


@OPTIMIZERS.register("adamw")
def adamw(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if cfg.state_dtype == "int8":
        with quiet_torchao_import():
            from torchao.optim import AdamW8bit

        # torchao keeps each group's lr as a tensor (its step is compiled); LambdaLR fills it in place.
        return AdamW8bit(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    fused = fused_supported(model) if cfg.fused is None else cfg.fused
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused)
