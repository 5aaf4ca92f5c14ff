"""Normalisation layers, chosen by `model.norm_type`."""

from __future__ import annotations

from torch import nn

from engine.config.registry import NORMS


@NORMS.register("rmsnorm")
def rms_norm(dim: int, eps: float) -> nn.Module:
    return nn.RMSNorm(dim, eps=eps)


@NORMS.register("layernorm")
def layer_norm(dim: int, eps: float) -> nn.Module:
    return nn.LayerNorm(dim, eps=eps)


def build_norm(norm_type: str, dim: int, eps: float) -> nn.Module:
    return NORMS.get(norm_type)(dim, eps)
