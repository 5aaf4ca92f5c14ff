"""Analytic parameter and FLOP counts from a `ModelConfig`, without torch (used by `validate-config`).

The model's own `num_parameters()` must equal `param_counts(cfg)["total"]`; a test holds them together.
"""

from __future__ import annotations

from engine.config.model import ModelConfig


def norm_params(cfg: ModelConfig, width: int) -> int:
    return width * (2 if cfg.norm_type == "layernorm" else 1)


def block_params(cfg: ModelConfig) -> int:
    d, hd = cfg.dim, cfg.head_dim
    attention = d * d + 2 * d * cfg.kv_heads * hd + d * d
    qk_norm = 2 * hd if cfg.qk_norm else 0
    mlp = 3 * d * cfg.ffn_dim
    return attention + qk_norm + mlp + 2 * norm_params(cfg, d)


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """embedding (the input table), output_head (0 when tied), blocks (+ final norm), total, non_embedding."""
    embedding = cfg.vocab_size * cfg.dim
    output_head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    blocks = cfg.n_layers * block_params(cfg) + norm_params(cfg, cfg.dim)
    total = embedding + output_head + blocks
    return {"embedding": embedding, "output_head": output_head, "blocks": blocks,
            "non_embedding": total - embedding, "total": total}


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward + backward FLOPs per token: 6 × (matmul parameters) + 12 × layers × dim × seq_len.

    Matmul parameters are the blocks' and the output head's (tied or not: the head matmul always runs);
    the embedding lookup and norms are not matmuls. The second term is attention's QKᵀ and AV, counted
    without the causal saving, as in PaLM's MFU definition.
    """
    d = cfg.dim
    per_block_matmul = block_params(cfg) - 2 * norm_params(cfg, d) - (2 * cfg.head_dim if cfg.qk_norm else 0)
    matmul_params = cfg.n_layers * per_block_matmul + cfg.vocab_size * d
    return 6 * matmul_params + 12 * cfg.n_layers * d * seq_len
