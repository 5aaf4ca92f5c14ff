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
    """`hidden` defaults to `cfg.ffn_dim`; MoE shared experts pass their own width."""

    def __init__(self, cfg: ModelConfig, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or cfg.ffn_dim
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)
        self.act = ACTIVATIONS.get(cfg.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))

    def input_weights(self) -> list[torch.Tensor]:
        """Weights that read the residual stream (initialised with init_std)."""
        return [self.w1.weight, self.w3.weight]

    def output_weights(self) -> list[torch.Tensor]:
        """Weights that write into the residual stream (initialised with the depth-scaled std)."""
        return [self.w2.weight]
