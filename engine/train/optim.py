"""Optimizers, chosen by `optimizer.name`. Weight decay applies to matrices only (not norms, biases, embeddings)."""

from __future__ import annotations

import torch
from torch import nn

from engine.config.optimizer import OptimizerConfig
from engine.config.registry import OPTIMIZERS


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: ≥2-D weights other than embeddings decay; norms, biases and embedding tables do not.

    A tied output head shares the embedding's parameter and so follows the embedding (no decay).
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 and id(param) not in embeddings else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def fused_supported(model: nn.Module) -> bool:
    """The fused AdamW kernel exists for CUDA and CPU floating-point parameters in the PyTorch we require."""
    return all(p.device.type in {"cuda", "cpu"} and p.is_floating_point() for p in model.parameters())


@OPTIMIZERS.register("adamw")
def adamw(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    fused = fused_supported(model) if cfg.fused is None else cfg.fused
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused)


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return OPTIMIZERS.get(cfg.name)(model, cfg)
