"""Rotary position embeddings in the "rotate half" layout (the one Hugging Face Llama uses), with the RoPE
scalings `transformers` implements for the Llama family (`model.rope_scaling`).

Using the same layout as `transformers` means exported q/k projections need no permutation.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from engine.config.model import ModelConfig


def linear_scaling(cfg: ModelConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """Position interpolation: every frequency divided by the factor, so position p turns as p / factor did."""
    return inv_freq / cfg.rope_scaling_factor


def llama3_scaling(cfg: ModelConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1's scaling, by wavelength λ = 2π / frequency against the original context L: a dimension that
    turns more than rope_high_freq_factor times over L keeps its frequency; one that turns fewer than
    rope_low_freq_factor times is divided by the factor; in between the two are blended linearly in the
    number of turns L / λ."""
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    turns = cfg.rope_original_max_seq_len / (2 * math.pi / inv_freq)
    keep = ((turns - low) / (high - low)).clamp(0.0, 1.0)  # 0: divide by the factor, 1: keep
    return (1 - keep) * (inv_freq / factor) + keep * inv_freq


SCALINGS: dict[str, Callable[[ModelConfig, torch.Tensor], torch.Tensor]] = {
    "none": lambda cfg, inv_freq: inv_freq,
    "linear": linear_scaling,
    "llama3": llama3_scaling,
}
"""`model.rope_scaling` → how it changes the frequencies (fp32 [head_dim / 2])."""


def rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [max_seq_len, head_dim], computed in fp32, with cfg's RoPE scaling."""
    head_dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    inv_freq = SCALINGS[cfg.rope_scaling](cfg, inv_freq)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [≥ seq, head_dim], of which the first seq rows are used, or
    [batch, seq, head_dim]: each sequence's own positions (packed documents restart theirs)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    else:
        seq = x.shape[-2]
        cos, sin = cos[:seq], sin[:seq]
    return (x * cos + rotate_half(x) * sin).to(x.dtype)
