"""GPT-2 (Radford et al. 2019) for one device, in the skeleton every Forge family keeps (`cfg`, blocks in the
`layers` ModuleDict, `tok_embeddings` … `norm`, `output`):

token embedding + learned position embedding → n_layers × [x + attn(ln(x)); x + mlp(ln(x))] → ln → head.

Every linear has a bias; the norms are LayerNorm (with bias); the MLP is dim → ffn_dim → dim through GELU in
its tanh approximation (transformers' `gelu_new`); the head is tied to the token embedding unless
`tie_embeddings = false`. Attention is PyTorch's SDPA through the shared `AttentionCore` (so context
parallelism can swap it), on separate q/k/v projections (GPT-2's checkpoints fuse them into one `c_attn`;
the Hugging Face mapping splits and joins it, engine/model/families/gpt2/hf.py): tensor parallelism then
shards whole heads of each.

The position embedding is looked up at each token's place in its sequence (`positions`): 0 … seq-1 in
training, after the cached positions in generation, the places in their documents for packed windows, and
the places a context-parallel rank holds (its hook passes them). A pipeline stage without the embeddings
takes hidden states, one without `output` returns its last block's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.config.model import ModelConfig
from engine.model.attention import AttentionCore
from engine.model.documents import document_positions, packed_attention_mask
from engine.model.kv_cache import KVCache, LayerKV


class GPT2Attention(nn.Module):
    """Causal multi-head self-attention with biased q/k/v/o projections and no position rotation."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim)
        self.wk = nn.Linear(cfg.dim, cfg.dim)
        self.wv = nn.Linear(cfg.dim, cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)
        self.core = AttentionCore(cfg.sdpa_backend)

    def forward(self, x: torch.Tensor, cache: LayerKV | None = None, mask: object = None) -> torch.Tensor:
        """x [batch, seq, dim]; `cache` (generation) as in engine.model.attention.Attention; `mask` the packed
        documents' mask (or a context-parallel core's), which replaces the causal flag."""
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        causal = mask is None
        if cache is not None:
            assert mask is None, "packed documents are a training-time layout; generation uses the cache's mask"
            k, v = cache.append(k, v)
            causal, mask = cache.start == 0, cache.mask(seq)
        out = self.core(q, k, v, mask, causal)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class GPT2MLP(nn.Module):
    """dim → ffn_dim → dim through GELU (tanh approximation), both linears biased."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = GPT2Attention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor, cache: LayerKV | None = None, mask: object = None) -> torch.Tensor:
        # mask by keyword: tensor parallelism's PrepareModuleInput lays out the positional inputs only.
        x = x + self.attention(self.attention_norm(x), cache, mask=mask)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT2(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # The embeddings, final norm and head become None on pipeline stages that do not own them.
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleDict({str(i): GPT2Block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        *,
        return_hidden: bool = False,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        attention_mask: object = None,
    ) -> torch.Tensor:
        """tokens [batch, seq] → logits [batch, seq, vocab], with the arguments of
        engine.model.transformer.Transformer.forward: a cache (generation), return_hidden (the final-normed
        hidden states), doc_ids (packed documents), positions ([seq] or [batch, seq]: where the tokens sit in
        their sequences, from a context-parallel rank's hook) and attention_mask (that hook's cores' mask)."""
        mask = attention_mask
        if doc_ids is not None:
            assert cache is None, "doc_ids are for packed training windows, not generation"
            positions, mask = document_positions(doc_ids), packed_attention_mask(doc_ids, self.cfg.head_dim)
        h = tokens if self.tok_embeddings is None else self.embed(tokens, cache, positions)
        for name, block in self.layers.items():
            h = block(h, None if cache is None else cache.layer(name, h.shape[1]), mask=mask)
        if cache is not None:
            cache.length += h.shape[1]
        if self.output is None:
            return h
        h = self.norm(h)
        return h if return_hidden else self.output(h)

    def embed(self, tokens: torch.Tensor, cache: KVCache | None, positions: torch.Tensor | None) -> torch.Tensor:
        """Token plus position embeddings. Positions go in as [batch or 1, seq], the layout both lookups share:
        under tensor parallelism each is a vocabulary-style lookup over the full sequence whose output is cut
        to this rank's positions (engine/model/families/gpt2/tp_plan.py), so the two sums line up."""
        if positions is None:
            start = 0 if cache is None else cache.length
            positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        if positions.dim() == 1:
            positions = positions[None]
        return self.tok_embeddings(tokens) + self.pos_embeddings(positions)

    def reset_rope_tables(self) -> None:
        """What a model built on the meta device recomputes after `to_empty` (engine/train/job.py calls it on
        every family): GPT-2 derives no tables from its config (its positions are learned weights)."""

    def new_kv_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty cache for `batch` sequences of up to `capacity` positions, on the model's device and dtype."""
        weight = self.tok_embeddings.weight
        return KVCache(self.cfg, list(self.layers), batch, capacity, weight.device, weight.dtype)

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's initialisation: Normal(0, init_std) for the embeddings and linears, biases zero,
        init_std / sqrt(2 · n_layers) for the projections writing into the residual stream (attention wo,
        MLP w2), LayerNorms at weight 1, bias 0."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for embedding in (self.tok_embeddings, self.pos_embeddings):
            if embedding is not None:
                nn.init.normal_(embedding.weight, std=std)
        for block in self.layers.values():
            attention, mlp = block.attention, block.feed_forward
            for linear in (attention.wq, attention.wk, attention.wv, attention.wo, mlp.w1, mlp.w2):
                is_output = linear is attention.wo or linear is mlp.w2
                nn.init.normal_(linear.weight, std=out_std if is_output else std)
                nn.init.zeros_(linear.bias)
        if self.output is not None and not self.cfg.tie_embeddings:
            nn.init.normal_(self.output.weight, std=std)
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def num_parameters(self) -> int:
        """Distinct parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())
