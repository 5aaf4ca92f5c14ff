"""The gated feed-forward block: act(x W1) ⊙ (x W3), then W2. silu gives SwiGLU, gelu GeGLU, relu ReGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config.model import ModelConfig
from engine.config.registry import ACTIVATIONS

ACTIVATIONS.register("silu")(F.silu)
ACTIVATIONS.register("gelu")(F.gelu)
ACTIVATIONS.register("relu")(F.relu)


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.act = ACTIVATIONS.get(cfg.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))
