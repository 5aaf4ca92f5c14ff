"""The decoder-only transformer, written for one device.

token embedding → n_layers × [x + attn(norm(x)); x + mlp(norm(x))] → norm → output head.
Parallelism (FSDP, TP, PP) is applied to this module from outside by `engine.parallel`; nothing here
knows about sharding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.config.model import ModelConfig
from engine.config.registry import MODELS
from engine.model.attention import Attention
from engine.model.kv_cache import KVCache, LayerKV
from engine.model.mlp import GatedMLP
from engine.model.norms import build_norm
from engine.model.rope import rope_tables


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = build_norm(cfg.norm_type, cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = build_norm(cfg.norm_type, cfg.dim, cfg.norm_eps)
        self.feed_forward = GatedMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerKV | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, cache)
        return x + self.feed_forward(self.ffn_norm(x))


@MODELS.register("transformer")
class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed by layer index keeps parameter names stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = build_norm(cfg.norm_type, cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        # Not persistent: derived from the config, so checkpoints hold only learned weights.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, *, return_hidden: bool = False) -> torch.Tensor:
        """tokens [batch, seq] → logits [batch, seq, vocab]. Without a cache (training) the tokens are
        positions 0 … seq-1; with one (inference) they continue the cached positions, and are added to it.
        With return_hidden, the final-normed hidden states [batch, seq, dim] instead of logits, for losses that
        project them through `output.weight` chunk by chunk (engine.train.losses.chunked_cross_entropy)."""
        seq = tokens.shape[1]
        start = 0 if cache is None else cache.length
        cos, sin = self.rope_cos[start:start + seq], self.rope_sin[start:start + seq]
        h = self.tok_embeddings(tokens)
        for name, block in self.layers.items():
            h = block(h, cos, sin, None if cache is None else cache.layer(name, seq))
        if cache is not None:
            cache.length += seq
        h = self.norm(h)
        return h if return_hidden else self.output(h)

    def new_kv_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty cache for `batch` sequences of up to `capacity` positions, on the model's device and dtype."""
        weight = self.tok_embeddings.weight
        return KVCache(self.cfg, list(self.layers), batch, capacity, weight.device, weight.dtype)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) everywhere; the projections that write into the residual stream (attention
        wo, MLP w2) get init_std / sqrt(2 · n_layers) so the residual's variance does not grow with depth."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        for block in self.layers.values():
            for linear in (block.attention.wq, block.attention.wk, block.attention.wv, block.feed_forward.w1, block.feed_forward.w3):
                nn.init.normal_(linear.weight, std=std)
            nn.init.normal_(block.attention.wo.weight, std=out_std)
            nn.init.normal_(block.feed_forward.w2.weight, std=out_std)
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.output.weight, std=std)
        for module in self.modules():
            if isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
                module.reset_parameters()

    def num_parameters(self) -> int:
        """Distinct parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())
