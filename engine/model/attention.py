"""Causal self-attention with grouped-query heads, optional QK-norm, q/k/v biases and sliding window, RoPE,
and PyTorch's SDPA kernels (packed documents on CUDA: FlexAttention)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask

from engine.config.model import ModelConfig
from engine.model.documents import flex_document_attention
from engine.model.kv_cache import LayerKV
from engine.model.mup import query_scale
from engine.model.rope import apply_rope

SDPA_BACKENDS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


class AttentionCore(nn.Module):
    """softmax(QK^T/sqrt(d) + mask)V on heads laid out (batch, heads, seq, head_dim), through SDPA.

    A module of its own, without parameters, so that what needs attention's inner tensors reaches them from
    outside the model: a forward hook sees the queries, keys and values after RoPE (activation extraction),
    and a layout can replace the kernel for the whole model at once (context parallelism)."""

    def __init__(self, sdpa_backend: str = "auto") -> None:
        super().__init__()
        self.sdpa_backend = sdpa_backend

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | BlockMask | None = None,
        causal: bool = True,
    ) -> torch.Tensor:
        if isinstance(mask, BlockMask):  # packed documents on CUDA (engine.model.documents)
            return flex_document_attention(q, k, v, mask)
        with self.kernel():
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
            )

    def kernel(self) -> contextlib.AbstractContextManager:
        """The SDPA kernel `model.sdpa_backend` chose (PyTorch's own choice for "auto"): part of the core's
        contract (`ModelParts.attention`), which a context-parallel core keeps for its own SDPA calls."""
        if self.sdpa_backend == "auto":
            return contextlib.nullcontext()
        return sdpa_kernel(SDPA_BACKENDS[self.sdpa_backend])


def sliding_window_mask(queries: int, keys: int, window: int, device: torch.device) -> torch.Tensor:
    """bool [queries, keys], True where query i (at position keys - queries + i) may see key j: j at most
    its position and fewer than `window` positions before it."""
    offset = torch.arange(queries, device=device)[:, None] + (keys - queries) - torch.arange(keys, device=device)
    return (offset >= 0) & (offset < window)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        bias = cfg.attention_qkv_bias
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # QK-norm is always RMSNorm over the head dimension, whatever norm_type the residual stream uses.
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.window = cfg.sliding_window
        self.core = AttentionCore(cfg.sdpa_backend)
        # μP's q·k/head_dim, applied to the queries so that every kernel (SDPA, flex, context parallel's) and
        # what a hook on the core sees agree; 1 under sp (engine/model/mup.py).
        self.query_scale = query_scale(cfg)

    def biases(self) -> list[nn.Parameter]:
        """The q/k/v projections' biases (model.attention_qkv_bias), none without."""
        return [proj.bias for proj in (self.wq, self.wk, self.wv) if proj.bias is not None]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerKV | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """cos/sin are the RoPE tables of x's positions ([seq, head_dim], or [batch, seq, head_dim] when each
        sequence has its own positions). With a cache (inference), x's keys and values are appended to it and
        x's queries attend over every cached position. `mask` (packed documents, engine.model.documents) is a
        boolean [batch, 1, seq, seq], or on CUDA a FlexAttention BlockMask, that already holds causality: it
        replaces the causal flag. With a sliding window (model.sliding_window) a query sees only the `window`
        latest keys up to its own position: the band is added to whatever mask there is (none: causal
        attention; the cache's; packed documents' dense one), the queries being the last of the keys'
        positions, and handed to the core as its mask (so that hooks on the core see it); a FlexAttention
        BlockMask already holds it (engine.model.documents builds it with the window)."""
        batch, seq, _ = x.shape
        # Head counts come from the projections' outputs, not the config: under tensor parallelism each rank
        # holds n_heads/tp query and n_kv_heads/tp key/value heads (engine.parallel.tp).
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        causal = mask is None
        if cache is not None:
            assert mask is None, "packed documents are a training-time layout; generation uses the cache's mask"
            k, v = cache.append(k, v)
            causal, mask = cache.start == 0, cache.mask(seq)
        if self.window is not None and not isinstance(mask, BlockMask):
            band = sliding_window_mask(q.shape[-2], k.shape[-2], self.window, q.device)
            mask, causal = band if mask is None else mask & band, False
        out = self.core(q, k, v, mask, causal)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
