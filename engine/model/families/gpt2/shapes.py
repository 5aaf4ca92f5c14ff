"""GPT-2's parameters and FLOPs from its `[model]` section, without torch. `param_specs` lists
`GPT2(cfg).named_parameters()` in registration order (tests hold them together)."""

from __future__ import annotations

from engine.config.model import ModelConfig
from engine.model.spec import ParamSpec


def linear_specs(prefix: str, out: int, inp: int, owner: int, tp_dim: int) -> list[ParamSpec]:
    """A biased linear [out, in]: column parallel (tp_dim 0) shards the bias with the rows, row parallel
    (tp_dim 1) keeps the bias whole (it is added once, after the reduction)."""
    return [
        ParamSpec(f"{prefix}.weight", (out, inp), owner, tp_dim),
        ParamSpec(f"{prefix}.bias", (out,), owner, 0 if tp_dim == 0 else None),
    ]


def layer_norm_specs(prefix: str, dim: int, owner: str | int) -> list[ParamSpec]:
    return [ParamSpec(f"{prefix}.weight", (dim,), owner), ParamSpec(f"{prefix}.bias", (dim,), owner)]


def block_specs(cfg: ModelConfig, layer: int) -> list[ParamSpec]:
    p, d, f = f"layers.{layer}", cfg.dim, cfg.ffn_dim
    specs = layer_norm_specs(f"{p}.attention_norm", d, layer)
    for name in ("wq", "wk", "wv"):
        specs += linear_specs(f"{p}.attention.{name}", d, d, layer, 0)
    specs += linear_specs(f"{p}.attention.wo", d, d, layer, 1)
    specs += layer_norm_specs(f"{p}.ffn_norm", d, layer)
    specs += linear_specs(f"{p}.feed_forward.w1", f, d, layer, 0)
    return specs + linear_specs(f"{p}.feed_forward.w2", d, f, layer, 1)


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Both embeddings belong to the first pipeline stage; tensor parallelism shards both by rows (the
    position table's rows are positions: engine/model/families/gpt2/tp_plan.py)."""
    specs = [
        ParamSpec("tok_embeddings.weight", (cfg.vocab_size, cfg.dim), "embedding", 0),
        ParamSpec("pos_embeddings.weight", (cfg.max_seq_len, cfg.dim), "embedding", 0),
    ]
    for layer in range(cfg.n_layers):
        specs += block_specs(cfg, layer)
    specs += layer_norm_specs("norm", cfg.dim, "norm")
    if not cfg.tie_embeddings:
        specs.append(ParamSpec("output.weight", (cfg.vocab_size, cfg.dim), "head", 0))
    return specs


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """embedding: the token and position tables (the lookups; Kaplan et al.'s non-embedding count leaves out
    both); output_head: 0 when tied; blocks (+ final norm); every parameter is active."""
    specs = param_specs(cfg)
    embedding = sum(s.numel for s in specs if s.owner == "embedding")
    output_head = sum(s.numel for s in specs if s.owner == "head")
    total = sum(s.numel for s in specs)
    return {
        "embedding": embedding,
        "output_head": output_head,
        "blocks": total - embedding - output_head,
        "non_embedding": total - embedding,
        "total": total,
        "active": total,
    }


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """6 × (the blocks' matmul weights + the head's) + 12 × layers × dim × seq_len (attention's QKᵀ and AV,
    without the causal saving, as the transformer family and PaLM's MFU count them). Biases, norms and the
    two embedding lookups are not matmuls."""
    d, f = cfg.dim, cfg.ffn_dim
    blocks = cfg.n_layers * (4 * d * d + 2 * d * f)
    return 6 * (blocks + cfg.vocab_size * d) + 12 * cfg.n_layers * d * seq_len
