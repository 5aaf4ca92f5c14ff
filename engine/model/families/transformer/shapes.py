"""The decoder-only transformer's parameters and FLOPs from its `[model]` section, without torch.

The model's own `num_parameters()` must equal `param_counts(cfg)["total"]`, and `param_specs(cfg)` its
`named_parameters()` shapes; tests hold them together.
"""

from __future__ import annotations

import dataclasses

from engine.config.model import ModelConfig
from engine.model.spec import ParamSpec


def norm_params(cfg: ModelConfig, width: int) -> int:
    return width * (2 if cfg.norm_type == "layernorm" else 1)


def query_width(cfg: ModelConfig) -> int:
    """wq's output width: the queries, and with the output gate (model.attention_output_gate) the gates too."""
    return cfg.attention_dim * (2 if cfg.attention_output_gate else 1)


def attention_params(cfg: ModelConfig) -> int:
    """The attention's matmul parameters: wq (with the gate's rows), wk, wv, wo, and the q/k/v biases
    (model.attention_qkv_bias)."""
    d, q, kv, wq = cfg.dim, cfg.attention_dim, cfg.kv_heads * cfg.head_dim, query_width(cfg)
    return d * wq + d * q + 2 * d * kv + (wq + 2 * kv if cfg.attention_qkv_bias else 0)


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
    sinks = cfg.n_heads if cfg.attention_sinks else 0
    vectors = qk_norm + sinks + 2 * norm_params(cfg, cfg.dim)
    return attention_params(cfg) + feed_forward_params(cfg, layer, active) + vectors


def mtp_module_params(cfg: ModelConfig) -> int:
    """One multi-token-prediction module: two input norms, the 2·dim → dim projection, a dense block, its norm."""
    dense = cfg.model_copy(update={"num_experts": 0})
    return 3 * norm_params(cfg, cfg.dim) + 2 * cfg.dim * cfg.dim + block_params(dense)


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """embedding (the input table), output_head (0 when tied), blocks (+ final norm), mtp (the multi-token-
    prediction modules, only when there are any), total, non_embedding,
    and active: the parameters one token runs through (= total for a dense model; for MoE, only top_k
    routed experts per MoE block count)."""
    embedding = cfg.vocab_size * cfg.dim
    output_head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    blocks = sum(block_params(cfg, i) for i in range(cfg.n_layers)) + norm_params(cfg, cfg.dim)
    inactive = sum(block_params(cfg, i) - block_params(cfg, i, active=True) for i in range(cfg.n_layers))
    mtp = cfg.mtp_depth * mtp_module_params(cfg)
    total = embedding + output_head + blocks + mtp
    return {
        "embedding": embedding,
        "output_head": output_head,
        "blocks": blocks,
        **({"mtp": mtp} if mtp else {}),
        "non_embedding": total - embedding,
        "total": total,
        "active": total - inactive,
    }


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward + backward FLOPs per token: 6 × (active matmul parameters) + 12 × layers × heads·head_dim ×
    keys, where keys = seq_len, or the sliding window when that is shorter (the keys a query attends to).

    Matmul parameters are the blocks' and the output head's (tied or not: the head matmul always runs);
    the embedding lookup and norms are not matmuls. For MoE only the active ones count (router, top_k
    routed and the shared experts), so MFU measures the work actually done. The second term is
    attention's QKᵀ and AV, counted without the causal saving, as in PaLM's MFU definition. The output gate
    (model.attention_output_gate) counts as wq's extra rows; its sigmoid and product, like the sinks' column of
    the softmax, are elementwise and not counted.
    Each multi-token-prediction module adds its projection, block and the head over every position (it runs
    over the whole window; its last k positions are cut from its loss: engine/train/losses.py, with_mtp_loss).
    """
    d = cfg.dim
    blocks = sum(attention_params(cfg) + feed_forward_params(cfg, i, active=True) for i in range(cfg.n_layers))
    keys = min(seq_len, cfg.sliding_window or seq_len)
    attention = 12 * cfg.attention_dim * keys  # per layer and token: scores and weighted values, fwd + bwd
    main = 6 * (blocks + cfg.vocab_size * d) + cfg.n_layers * attention
    module = 6 * (2 * d * d + attention_params(cfg) + 3 * d * cfg.ffn_dim + cfg.vocab_size * d) + attention
    return main + cfg.mtp_depth * module


def norm_specs(cfg: ModelConfig, prefix: str, width: int, owner: str | int) -> list[ParamSpec]:
    specs = [ParamSpec(f"{prefix}.weight", (width,), owner)]
    if cfg.norm_type == "layernorm":
        specs.append(ParamSpec(f"{prefix}.bias", (width,), owner))
    return specs


def mlp_specs(prefix: str, dim: int, hidden: int, owner: int) -> list[ParamSpec]:
    """A gated MLP: w1/w3 [hidden, dim] (column parallel: rows), w2 [dim, hidden] (row parallel: columns)."""
    return [
        ParamSpec(f"{prefix}.w1.weight", (hidden, dim), owner, 0),
        ParamSpec(f"{prefix}.w3.weight", (hidden, dim), owner, 0),
        ParamSpec(f"{prefix}.w2.weight", (dim, hidden), owner, 1),
    ]


def moe_specs(cfg: ModelConfig, prefix: str, layer: int) -> list[ParamSpec]:
    """Router gate (replicated over tp), routed experts (packed [E, …] tensors, whose hidden units tensor
    parallelism splits and whose experts expert parallelism splits, or one module per expert, which neither
    takes), shared experts (a tensor-parallel MLP)."""
    d, h, e = cfg.dim, cfg.expert_ffn_dim, cfg.num_experts
    specs = [ParamSpec(f"{prefix}.router.gate.weight", (e, d), layer)]
    if cfg.moe_packed_experts:
        specs += [
            ParamSpec(f"{prefix}.experts.w1", (e, d, h), layer, 2, expert_parallel=True),
            ParamSpec(f"{prefix}.experts.w3", (e, d, h), layer, 2, expert_parallel=True),
            ParamSpec(f"{prefix}.experts.w2", (e, h, d), layer, 1, expert_parallel=True),
        ]
    else:
        for i in range(e):
            specs += [
                ParamSpec(f"{prefix}.experts.{i}.w1", (d, h), layer),
                ParamSpec(f"{prefix}.experts.{i}.w3", (d, h), layer),
                ParamSpec(f"{prefix}.experts.{i}.w2", (h, d), layer),
            ]
    if cfg.moe_shared_experts:
        specs += mlp_specs(f"{prefix}.shared", d, cfg.moe_shared_experts * h, layer)
    return specs


def block_specs(cfg: ModelConfig, layer: int) -> list[ParamSpec]:
    p, d, q, kv = f"layers.{layer}", cfg.dim, cfg.attention_dim, cfg.kv_heads * cfg.head_dim
    specs = norm_specs(cfg, f"{p}.attention_norm", d, layer)
    for name, width in (("wq", query_width(cfg)), ("wk", kv), ("wv", kv)):
        specs.append(ParamSpec(f"{p}.attention.{name}.weight", (width, d), layer, 0))
        if cfg.attention_qkv_bias:  # column parallel like its weight's rows
            specs.append(ParamSpec(f"{p}.attention.{name}.bias", (width,), layer, 0))
    specs.append(ParamSpec(f"{p}.attention.wo.weight", (d, q), layer, 1))
    if cfg.qk_norm:
        specs += [
            ParamSpec(f"{p}.attention.q_norm.weight", (cfg.head_dim,), layer),
            ParamSpec(f"{p}.attention.k_norm.weight", (cfg.head_dim,), layer),
        ]
    if cfg.attention_sinks:  # one per query head: sharded with the heads
        specs.append(ParamSpec(f"{p}.attention.sinks.weight", (cfg.n_heads,), layer, 0))
    specs += norm_specs(cfg, f"{p}.ffn_norm", d, layer)
    if cfg.is_moe_layer(layer):
        return specs + moe_specs(cfg, f"{p}.feed_forward", layer)
    return specs + mlp_specs(f"{p}.feed_forward", d, cfg.ffn_dim, layer)


def mtp_specs(cfg: ModelConfig, k: int) -> list[ParamSpec]:
    """Multi-token-prediction module k (owner "mtp", which only the last pipeline stage could hold): norms,
    projection, a dense block (`block_specs` of a dense copy, renamed), final norm; under tensor parallelism
    the projection sharded by output features and the block as a dense block (tp_plan.mtp_plan)."""
    p, d = f"mtp.{k}", cfg.dim
    specs = norm_specs(cfg, f"{p}.hidden_norm", d, "mtp") + norm_specs(cfg, f"{p}.embed_norm", d, "mtp")
    specs.append(ParamSpec(f"{p}.proj.weight", (d, 2 * d), "mtp", 0))
    dense = cfg.model_copy(update={"num_experts": 0})
    for spec in block_specs(dense, 0):
        name = spec.name.replace("layers.0.", f"{p}.block.", 1)
        specs.append(dataclasses.replace(spec, name=name, owner="mtp"))
    return specs + norm_specs(cfg, f"{p}.norm", d, "mtp")


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Every parameter tensor of `Transformer(cfg)`, in registration order (a tied head is the embedding)."""
    specs = [ParamSpec("tok_embeddings.weight", (cfg.vocab_size, cfg.dim), "embedding", 0)]
    for layer in range(cfg.n_layers):
        specs += block_specs(cfg, layer)
    specs += norm_specs(cfg, "norm", cfg.dim, "norm")
    if not cfg.tie_embeddings:
        specs.append(ParamSpec("output.weight", (cfg.vocab_size, cfg.dim), "head", 0))
    for k in range(1, cfg.mtp_depth + 1):
        specs += mtp_specs(cfg, k)
    assert sum(s.numel for s in specs) == param_counts(cfg)["total"], "param_specs out of step with param_counts"
    return specs
