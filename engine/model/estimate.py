"""Analytic parameter and FLOP counts from a `ModelConfig`, without torch (used by `validate-config`).

The model's own `num_parameters()` must equal `param_counts(cfg)["total"]`; a test holds them together.
"""

from __future__ import annotations

from engine.config.model import ModelConfig


def norm_params(cfg: ModelConfig, width: int) -> int:
    return width * (2 if cfg.norm_type == "layernorm" else 1)


def attention_params(cfg: ModelConfig) -> int:
    d = cfg.dim
    return d * d + 2 * d * cfg.kv_heads * cfg.head_dim + d * d


def feed_forward_params(cfg: ModelConfig, layer: int, active: bool = False) -> int:
    """The block's MLP; for an MoE block the router, the routed experts (only top_k of them when
    `active`: those one token runs through) and the shared experts."""
    d = cfg.dim
    if not cfg.is_moe_layer(layer):
        return 3 * d * cfg.ffn_dim
    expert = 3 * d * cfg.expert_ffn_dim
    routed = cfg.moe_top_k if active else cfg.num_experts
    return cfg.num_experts * d + routed * expert + cfg.moe_shared_experts * expert


def block_params(cfg: ModelConfig, layer: int = 0, active: bool = False) -> int:
    qk_norm = 2 * cfg.head_dim if cfg.qk_norm else 0
    return attention_params(cfg) + qk_norm + feed_forward_params(cfg, layer, active) + 2 * norm_params(cfg, cfg.dim)


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """embedding (the input table), output_head (0 when tied), blocks (+ final norm), total, non_embedding,
    and active: the parameters one token runs through (= total for a dense model; for MoE, only top_k
    routed experts per MoE block count)."""
    embedding = cfg.vocab_size * cfg.dim
    output_head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    blocks = sum(block_params(cfg, i) for i in range(cfg.n_layers)) + norm_params(cfg, cfg.dim)
    inactive = sum(block_params(cfg, i) - block_params(cfg, i, active=True) for i in range(cfg.n_layers))
    total = embedding + output_head + blocks
    return {
        "embedding": embedding,
        "output_head": output_head,
        "blocks": blocks,
        "non_embedding": total - embedding,
        "total": total,
        "active": total - inactive,
    }


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward + backward FLOPs per token: 6 × (active matmul parameters) + 12 × layers × dim × seq_len.

    Matmul parameters are the blocks' and the output head's (tied or not: the head matmul always runs);
    the embedding lookup and norms are not matmuls. For MoE only the active ones count (router, top_k
    routed and the shared experts), so MFU measures the work actually done. The second term is
    attention's QKᵀ and AV, counted without the causal saving, as in PaLM's MFU definition.
    """
    d = cfg.dim
    blocks = sum(attention_params(cfg) + feed_forward_params(cfg, i, active=True) for i in range(cfg.n_layers))
    return 6 * (blocks + cfg.vocab_size * d) + 12 * cfg.n_layers * d * seq_len
