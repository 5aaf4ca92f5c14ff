"""AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization"): PyTorch's implementation, or with
`optimizer.state_dtype = "int8"` torchao's `AdamW8bit` (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization"), whose moments are stored as block-wise 8-bit codes and whose update is computed in fp32, and
with `optimizer.weight_dtype = "bf16"` torchao's AdamW on bf16 weights with stochastic rounding."""

from __future__ import annotations

import torch
from torch import nn

from engine.parallel.float8 import quiet_torchao_import
from engine.train.optim.adamw_config import AdamWConfig
from engine.train.optim.groups import hidden_matrices, param_groups


def fused_supported(model: nn.Module) -> bool:
    """The fused AdamW kernel exists for CUDA and CPU floating-point parameters in the PyTorch we require."""
    return all(p.device.type in {"cuda", "cpu"} and p.is_floating_point() for p in model.parameters())


def adamw(model: nn.Module, cfg: AdamWConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if cfg.state_dtype != "fp32" or cfg.weight_dtype != "fp32":
        return torchao_adamw(model, groups, cfg)
    fused = fused_supported(model) if cfg.fused is None else cfg.fused
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused)


def torchao_adamw(model: nn.Module, groups: list[dict], cfg: AdamWConfig) -> torch.optim.Optimizer:
    """torchao's AdamW8bit (int8 moments for the hidden matrices: engine/train/optim/adamw8bit.py), or its AdamW
    for bf16 weights with bf16 moments (`_AdamW`, the class torchao documents for bf16 stochastic rounding);
    with bf16 weights, each update is computed in fp32 and stochastically rounded to bf16 (unbiased: small
    updates are not lost to rounding). torchao keeps each group's lr as a tensor (its step is compiled);
    LambdaLR fills it in place."""
    rounding = cfg.weight_dtype == "bf16"
    kwargs = {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "bf16_stochastic_round": rounding}
    with quiet_torchao_import():
        from torchao.optim import _AdamW

        if cfg.state_dtype == "int8":
            from engine.train.optim.adamw8bit import HiddenAdamW8bit

            return HiddenAdamW8bit(groups, quantized=frozenset(map(id, hidden_matrices(model))), **kwargs)
    return _AdamW(groups, **kwargs)
