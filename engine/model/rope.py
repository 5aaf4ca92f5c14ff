"""Rotary position embeddings in the "rotate half" layout (the one Hugging Face Llama uses).

Using the same layout as `transformers` means exported q/k projections need no permutation.
"""

from __future__ import annotations

import torch


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [max_seq_len, head_dim], computed in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
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
