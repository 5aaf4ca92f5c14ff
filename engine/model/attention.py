"""Causal self-attention with grouped-query heads, optional QK-norm, q/k/v biases, sliding window, gated output
and sink logits, RoPE, and PyTorch's SDPA kernels (packed documents on CUDA: FlexAttention; sinks, which no
SDPA kernel takes: an eager softmax, or FlexAttention's log-sum-exp for packed documents on CUDA)."""

from __future__ import annotations

import contextlib
import math

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
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`sinks` (model.attention_sinks): one logit per query head [heads] that joins each query's softmax
        denominator; no SDPA kernel takes it, so it runs eagerly (`sink_attention`) or, for packed documents
        on CUDA, through FlexAttention's log-sum-exp."""
        if isinstance(mask, BlockMask):  # packed documents on CUDA (engine.model.documents)
            return flex_document_attention(q, k, v, mask, sinks)
        if sinks is not None:
            return sink_attention(q, k, v, mask, causal, sinks)
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


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, sinks: torch.Tensor
) -> torch.Tensor:
    """softmax([QKᵀ/sqrt(d) + mask, sink])V without the sink's column: each head's sink logit takes its share
    of every query's attention and contributes no value (GPT-OSS). Eager, as SDPA's math kernel is: the
    scores are formed in the inputs' dtype, the softmax taken in fp32 (or the inputs' wider dtype) and cast back for the values' matmul
    (as SDPA and GPT-OSS do), so it keeps the [heads, queries, keys + 1] weights. `mask` is a boolean
    [.., queries, keys] (True: may attend) or None: causal when `causal` (the queries being the last of the
    keys' positions), otherwise every key."""
    queries, keys = q.shape[-2], k.shape[-2]
    if k.shape[1] != q.shape[1]:  # grouped-query: each key/value head serves n_heads / kv_heads query heads
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is None and causal:
        mask = sliding_window_mask(queries, keys, keys, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    wide = torch.promote_types(q.dtype, torch.float32)  # the sink logit is not rounded to a bf16 score's precision
    sink = sinks.to(wide)[None, :, None, None].expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores.to(wide), sink], dim=-1), dim=-1)
    return weights[..., :-1].to(v.dtype) @ v


def sliding_window_mask(queries: int, keys: int, window: int, device: torch.device) -> torch.Tensor:
    """bool [queries, keys], True where query i (at position keys - queries + i) may see key j: j at most
    its position and fewer than `window` positions before it."""
    offset = torch.arange(queries, device=device)[:, None] + (keys - queries) - torch.arange(keys, device=device)
    return (offset >= 0) & (offset < window)


class AttentionSinks(nn.Module):
    """GPT-OSS's sink logits (model.attention_sinks), one per query head. A module of its own so that the
    tensor-parallel plan shards it with the heads (engine.parallel.tp's "head_sharded_vector"); calling it gives
    the logits of this rank's heads."""

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_heads))

    def forward(self) -> torch.Tensor:
        return self.weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        bias = cfg.attention_qkv_bias
        # With the output gate (Qwen3-Next) wq also makes the gate: each head's head_dim query rows followed by
        # its head_dim gate rows, Qwen3-Next's own q_proj layout, so that a column shard holds whole heads.
        self.output_gate = cfg.attention_output_gate
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim * (2 if self.output_gate else 1), bias=bias)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # QK-norm is always RMSNorm over the head dimension, whatever norm_type the residual stream uses.
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.window = cfg.sliding_window
        self.sinks = AttentionSinks(cfg.n_heads) if cfg.attention_sinks else None
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
        BlockMask already holds it (engine.model.documents builds it with the window). With the output gate
        (model.attention_output_gate) the heads' outputs are multiplied by the sigmoid of their gates before
        wo; with sinks (model.attention_sinks) the core takes this rank's heads' sink logits."""
        batch, seq, _ = x.shape
        # Head counts come from the projections' outputs, not the config: under tensor parallelism each rank
        # holds n_heads/tp query and n_kv_heads/tp key/value heads (engine.parallel.tp).
        q = self.wq(x).view(batch, seq, -1, self.head_dim * (2 if self.output_gate else 1))
        if self.output_gate:
            q, gate = q.chunk(2, dim=-1)
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
        if self.sinks is None:
            out = self.core(q, k, v, mask, causal)
        else:
            out = self.core(q, k, v, mask, causal, self.sinks())
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        if self.output_gate:
            out = out * torch.sigmoid(gate.reshape(batch, seq, -1))
        return self.wo(out)
