"""How the transformer family corresponds to Hugging Face `transformers` architectures, both ways (torch-free:
engine/checkpoint/hf_mapping.py and hf.py move the tensors).

Forge's block is the Llama block: RMSNorm, RoPE in the rotate-half layout (so q/k weights need no
permutation), grouped-query attention without biases, and a SwiGLU MLP. With `qk_norm` it is the Qwen3
block instead (the same, plus an RMSNorm over each head's queries and keys before RoPE, with the model's
norm eps); with `attention_qkv_bias` the Qwen2 block (biases on q, k and v, not o); with a
`sliding_window` and neither, the Mistral block (Qwen2 and Qwen3 take the window too, on every layer:
max_window_layers = 0). `attention_head_dim` is every class's head_dim, and `rope_scaling` their
rope_parameters (rope_type "linear" or "llama3"). Anything else (LayerNorm, GeGLU/ReGLU, QK-norm with q/k/v
biases) has no equivalent there and is refused, never exported under a name that would compute something
different.

Mixture-of-experts models map to the transformers MoE class whose routing is exactly Forge's (the logits
tests prove each one):
- `softmax_topk` router (top-k of the softmax, weights not renormalised), no shared experts:
  Qwen3-MoE with qk_norm, Qwen2-MoE without (norm_topk_prob = false; MoE in every
  `decoder_sparse_step` = moe_frequency-th block, like Forge). Qwen2-MoE always has a shared expert behind
  a learned sigmoid gate; it is exported with width 0, so it adds exactly 0.
- `softmax_topk_renorm` router (the same top-k, weights renormalised), no shared experts: Mixtral
  (MixtralForCausalLM) when every block is MoE, there is no qk_norm and the experts are as wide as the
  dense FFN (Mixtral has one intermediate_size, the experts'); otherwise Qwen3-MoE / Qwen2-MoE as above
  with norm_topk_prob = true. Mixtral folders are read and written in the Hub's layout
  (`block_sparse_moe.experts.{e}.w1/w3/w2`, which transformers fuses on load).
- `sigmoid_topk` router (DeepSeek-V3 routing: top-k of sigmoid score + balancing bias, chosen scores
  renormalised, optionally group-limited), with or without shared experts: GLM-4-MoE (Glm4MoeForCausalLM),
  which has DeepSeek-V3's router (n_group = moe_n_group, topk_group = moe_topk_group,
  routed_scaling_factor = 1) and ungated shared experts with standard GQA attention (optional qk norm, full
  rotary). DeepSeek-V3 itself is not used: its attention is MLA (low-rank, normalised key/value
  compression, split RoPE), which Forge's attention cannot express. GLM-4-MoE's dense blocks come first
  (first_k_dense_replace), so the MoE blocks must be the last ones.
- shared experts with a softmax router have no equivalent (Qwen2-MoE gates its shared expert by a learned
  sigmoid; Forge adds it ungated) and are refused, as is a capacity limit that can drop tokens
  (transformers never drops).
  q/k/v biases export with Qwen2-MoE only (its qkv_bias); a sliding window with no MoE class (Qwen2-MoE and
  Qwen3-MoE slide on alternate layers only, GLM-4-MoE and Mixtral's Hub configs not at all).

Experts are written one tensor per expert and projection (`mlp.experts.{e}.gate_proj.weight`, …), the
layout the Hub checkpoints of these models use and transformers' save_pretrained writes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from engine.config.model import ModelConfig
from engine.errors import UserError
from engine.model.mup import output_multiplier, query_scale
from engine.model.rules import expert_group_issues
from engine.model.spec import HFMapping, Piece

LLAMA, QWEN3 = "LlamaForCausalLM", "Qwen3ForCausalLM"
QWEN2, MISTRAL = "Qwen2ForCausalLM", "MistralForCausalLM"
QWEN2_MOE, QWEN3_MOE, GLM4_MOE = "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM"
MIXTRAL = "MixtralForCausalLM"
MODEL_TYPES = {
    LLAMA: "llama",
    QWEN3: "qwen3",
    QWEN2: "qwen2",
    MISTRAL: "mistral",
    QWEN2_MOE: "qwen2_moe",
    QWEN3_MOE: "qwen3_moe",
    GLM4_MOE: "glm4_moe",
    MIXTRAL: "mixtral",
}
MOE_ARCHITECTURES = (QWEN2_MOE, QWEN3_MOE, GLM4_MOE, MIXTRAL)
SOFTMAX_ROUTERS = ("softmax_topk", "softmax_topk_renorm")
QWEN_WINDOWED = (QWEN2, QWEN3)  # their sliding window: use_sliding_window, on layers from max_window_layers on
MISTRAL_DEFAULT_WINDOW = 4096  # what MistralConfig assumes when config.json has no sliding_window

# Inside block i: Forge "layers.{i}.<key>" ↔ HF "model.layers.{i}.<value>".
LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
QK_NORM_NAMES = ("attention.q_norm.weight", "attention.k_norm.weight")
QKV_BIAS_NAMES = ("attention.wq.bias", "attention.wk.bias", "attention.wv.bias")
DENSE_FFN_NAMES = ("feed_forward.w1.weight", "feed_forward.w3.weight", "feed_forward.w2.weight")
# Forge expert / shared-expert projection ↔ HF projection (Mixtral's Hub checkpoints keep the names w1/w3/w2).
PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# The HF name of an MoE block's module: "mlp", but Mixtral's Hub checkpoints say block_sparse_moe.
MOE_MODULE = {MIXTRAL: "block_sparse_moe"}
# The HF name of the shared expert module of an MoE block (Qwen3-MoE has none).
SHARED = {QWEN2_MOE: "shared_expert", GLM4_MOE: "shared_experts"}
OUTER_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Fields that decide what the weights compute; a model and an HF folder must agree on all of them.
ARCHITECTURE_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "kv_heads",
    "head_dim",
    "attention_qkv_bias",
    "vocab_size",
    "ffn_dim",
    "norm_type",
    "norm_eps",
    "activation",
    "rope_theta",
    "rope_scaling",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_seq_len",
    "sliding_window",
    "tie_embeddings",
    "qk_norm",
    "attention_output_gate",
    "attention_sinks",
    "num_experts",
    "moe_top_k",
    "moe_frequency",
    "moe_router",
    "moe_n_group",
    "moe_topk_group",
    "moe_shared_experts",
    "expert_ffn_dim",
    "parametrization",  # HF folders are sp (a μP export has its scales folded in): a μP model cannot take them
)


def hf_architecture(cfg: ModelConfig) -> str:
    """The `transformers` class that computes exactly what `cfg` does, or a UserError naming the field."""
    if cfg.norm_type != "rmsnorm":
        raise UserError(
            f"model.norm_type = {cfg.norm_type!r} has no equivalent in the transformers models Forge "
            "exports to (Llama, Qwen3, Qwen2/3-MoE, GLM-4-MoE: they use RMSNorm)",
            'only models trained with norm_type = "rmsnorm" export to Hugging Face',
        )
    if cfg.activation != "silu":
        raise UserError(
            f"model.activation = {cfg.activation!r} has no equivalent in the transformers models Forge "
            "exports to (Llama, Qwen3, Qwen2/3-MoE, GLM-4-MoE: their MLPs are SwiGLU)",
            'only models trained with activation = "silu" export to Hugging Face',
        )
    for field, model in (("attention_output_gate", "Qwen3-Next"), ("attention_sinks", "GPT-OSS")):
        if getattr(cfg, field):
            raise UserError(
                f"model.{field} has no transformers class Forge exports to: {model} has it, but the rest of "
                f"{model}'s layers are not Forge's (Qwen3-Next: gated delta-net layers, a gated shared expert and "
                "partial RoPE; GPT-OSS: biased, clamped experts and an o_proj bias)",
                f"only models without model.{field} export to Hugging Face",
            )
    if cfg.is_moe:
        return moe_architecture(cfg)
    if cfg.qk_norm and cfg.attention_qkv_bias:
        raise UserError(
            "model.qk_norm with model.attention_qkv_bias has no equivalent in transformers (Qwen3 has QK-norm "
            "and no q/k/v biases, Qwen2 the biases and no QK-norm)",
            "models with one of the two export (Qwen3, Qwen2); both together do not",
        )
    if cfg.qk_norm:
        return QWEN3
    if cfg.attention_qkv_bias:
        return QWEN2
    return MISTRAL if cfg.sliding_window is not None else LLAMA


def moe_architecture(cfg: ModelConfig) -> str:
    """The MoE class whose routing is exactly `cfg`'s (see the module docstring), or a UserError naming the field."""
    if cfg.sliding_window is not None:
        raise UserError(
            f"model.sliding_window = {cfg.sliding_window} with model.num_experts = {cfg.num_experts} has no "
            "equivalent in transformers' MoE models (Qwen2-MoE and Qwen3-MoE slide on alternate layers only, "
            "GLM-4-MoE not at all)",
            "only dense models with a sliding window export (Mistral, Qwen2, Qwen3)",
        )
    capacity = cfg.moe_capacity
    if capacity is not None and capacity * cfg.moe_top_k < cfg.num_experts:
        raise UserError(
            f"model.moe_capacity_factor = {capacity}: Forge's forward drops routed assignments beyond an "
            "expert's capacity, and no transformers MoE model drops any, so the export would compute "
            "something else",
            f"only a capacity factor >= num_experts / moe_top_k "
            f"({cfg.num_experts / cfg.moe_top_k:g}), which never drops, or none exports",
        )
    if cfg.moe_router in SOFTMAX_ROUTERS:
        if cfg.moe_shared_experts:
            raise UserError(
                f"model.moe_shared_experts = {cfg.moe_shared_experts} with moe_router = {cfg.moe_router!r} "
                "has no equivalent in transformers: Qwen2-MoE scales its shared expert by a learned "
                "sigmoid gate, Forge adds it ungated",
                "softmax routers export without shared experts; sigmoid_topk models (GLM-4-MoE) export with them",
            )
        if cfg.qk_norm:
            architecture = QWEN3_MOE
        else:  # Mixtral has no q/k/v biases: such a model goes to Qwen2-MoE, renormalising or not
            architecture = MIXTRAL if is_mixtral(cfg) and not cfg.attention_qkv_bias else QWEN2_MOE
        if cfg.attention_qkv_bias and architecture != QWEN2_MOE:
            raise UserError(
                "model.attention_qkv_bias with model.qk_norm in an MoE model has no equivalent in transformers "
                "(Qwen3-MoE has no q/k/v biases; Qwen2-MoE has them, without QK-norm)",
                "softmax_topk models with q/k/v biases export without qk_norm (Qwen2-MoE)",
            )
        return architecture
    if cfg.attention_qkv_bias:
        raise UserError(
            'model.attention_qkv_bias with model.moe_router = "sigmoid_topk" has no equivalent in transformers '
            "(GLM-4-MoE has no q/k/v-only biases)",
            "sigmoid_topk models export without attention_qkv_bias",
        )
    if cfg.num_experts < 2:
        raise UserError(
            f"model.num_experts = {cfg.num_experts}: GLM-4-MoE's sigmoid router needs at least 2 experts",
            "sigmoid_topk models with 2 or more experts export to Hugging Face",
        )
    if first_dense_layers(cfg) is None:
        raise UserError(
            f"model.moe_frequency = {cfg.moe_frequency} with n_layers = {cfg.n_layers} interleaves dense "
            "and MoE blocks, but GLM-4-MoE (the transformers model with Forge's sigmoid_topk routing) "
            "only has its dense blocks first (first_k_dense_replace)",
            "sigmoid_topk models export with moe_frequency = 1, or = n_layers (only the last block MoE)",
        )
    return GLM4_MOE


def is_mixtral(cfg: ModelConfig) -> bool:
    """Whether Mixtral computes `cfg` (without qk_norm): renormalised softmax routing in every block, with
    experts as wide as the one intermediate_size Mixtral's config has."""
    return cfg.moe_router == "softmax_topk_renorm" and cfg.moe_frequency == 1 and cfg.expert_ffn_dim == cfg.ffn_dim


def first_dense_layers(cfg: ModelConfig) -> int | None:
    """k when the MoE blocks are exactly blocks k … n_layers-1 (GLM-4-MoE's first_k_dense_replace), else None."""
    moe = [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]
    return moe[0] if moe and moe == list(range(moe[0], cfg.n_layers)) else None


def hf_config(cfg: ModelConfig, dtype_name: str, eos_id: int | None, bos_id: int | None) -> dict[str, Any]:
    """config.json for `cfg` with weights in `dtype_name` ("bfloat16", …), whose tokenizer ends documents with
    `eos_id` and starts texts with `bos_id`. RoPE's base and scaling are written both the transformers 4 way
    (rope_theta, rope_scaling) and the transformers 5 way (rope_parameters), so either version reads the same
    model."""
    architecture = hf_architecture(cfg)
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": MODEL_TYPES[architecture],
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope_parameters(cfg),
        "rope_scaling": rope_scaling(cfg),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "torch_dtype": dtype_name,
        "use_cache": True,
    }
    if architecture == LLAMA:
        config["mlp_bias"] = False
    elif architecture == MISTRAL:
        config["sliding_window"] = cfg.sliding_window
    elif architecture in (GLM4_MOE, MIXTRAL):
        config.update(moe_config(cfg, architecture))
    else:
        windowed = cfg.sliding_window is not None
        config.update(
            use_sliding_window=windowed,
            sliding_window=cfg.sliding_window,
            max_window_layers=0 if windowed else cfg.n_layers,  # every layer slides from layer 0 on
        )
        if architecture in MOE_ARCHITECTURES:
            config.update(moe_config(cfg, architecture))
    # The token the exported tokenizer starts a text with (the end-of-text token Forge trains each document
    # after); without an explicit value transformers would take its default start token, an arbitrary id here.
    config["bos_token_id"] = bos_id
    if eos_id is not None:
        config["eos_token_id"] = eos_id
    return config


def moe_config(cfg: ModelConfig, architecture: str) -> dict[str, Any]:
    """The MoE part of config.json: Forge's routing in each architecture's terms."""
    common = {
        "num_experts_per_tok": cfg.moe_top_k,
        "moe_intermediate_size": cfg.expert_ffn_dim,
        "output_router_logits": False,
    }
    if architecture == GLM4_MOE:
        return {
            **common,
            "n_routed_experts": cfg.num_experts,
            "n_shared_experts": cfg.moe_shared_experts,
            "first_k_dense_replace": first_dense_layers(cfg),
            "n_group": cfg.moe_n_group,
            "topk_group": cfg.moe_topk_group,
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.0,
            "use_qk_norm": cfg.qk_norm,
            "partial_rotary_factor": 1.0,
            "num_nextn_predict_layers": 0,
            "rope_parameters": {**rope_parameters(cfg), "partial_rotary_factor": 1.0},
        }
    if architecture == MIXTRAL:  # intermediate_size is the experts' width (is_mixtral: the same as ffn_dim)
        return {
            "num_experts_per_tok": cfg.moe_top_k,
            "output_router_logits": False,
            "num_local_experts": cfg.num_experts,
            "router_aux_loss_coef": cfg.moe_aux_loss_weight,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    config = {
        **common,
        "num_experts": cfg.num_experts,
        "norm_topk_prob": cfg.moe_router == "softmax_topk_renorm",
        "decoder_sparse_step": cfg.moe_frequency,
        "mlp_only_layers": [],
        "router_aux_loss_coef": cfg.moe_aux_loss_weight,
    }  # what their training would use; not inference
    if architecture == QWEN2_MOE:
        config.update(shared_expert_intermediate_size=0, qkv_bias=cfg.attention_qkv_bias)
    return config


def rope_scaling(cfg: ModelConfig) -> dict[str, Any] | None:
    """transformers' RoPE scaling parameters for cfg's `rope_scaling` (None for plain RoPE)."""
    if cfg.rope_scaling == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_scaling_factor}
    if cfg.rope_scaling == "llama3":
        scaling.update(
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_seq_len,
        )
    return scaling


def rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """transformers 5's rope_parameters: the base and the scaling together."""
    return {"rope_type": "default", "rope_theta": cfg.rope_theta, **(rope_scaling(cfg) or {})}


def model_config_from_hf(config: dict[str, Any], source: str) -> ModelConfig:
    """The `[model]` section that computes what an HF config.json of one of the architectures above
    describes; anything Forge's model cannot reproduce exactly (other architectures, biases on the output
    projection or the MLP, other RoPE scalings, other routing, ...) is a UserError."""
    architecture = read_architecture(config, source)
    refuse_unsupported(config, architecture, source)
    heads = required(config, "num_attention_heads", source)
    dim = required(config, "hidden_size", source)
    head_dim = config.get("head_dim") or dim // heads
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}  # transformers 5 reads them so
    ffn_dim = required(config, "intermediate_size", source)
    qk_norm = architecture in (QWEN3, QWEN3_MOE) or (architecture == GLM4_MOE and bool(config.get("use_qk_norm")))
    moe = moe_fields_from_hf(config, architecture, ffn_dim, source) if architecture in MOE_ARCHITECTURES else {}
    try:
        cfg = ModelConfig(
            dim=dim,
            n_layers=required(config, "num_hidden_layers", source),
            n_heads=heads,
            n_kv_heads=config.get("num_key_value_heads") or heads,
            attention_head_dim=None if head_dim * heads == dim else head_dim,
            attention_qkv_bias=architecture == QWEN2
            or (architecture == QWEN2_MOE and bool(config.get("qkv_bias", True))),
            sliding_window=sliding_window_from_hf(config, architecture, source),
            vocab_size=required(config, "vocab_size", source),
            ffn_hidden_dim=ffn_dim,
            norm_type="rmsnorm",
            norm_eps=config.get("rms_norm_eps", 1e-6),
            activation="silu",
            max_seq_len=config.get("max_position_embeddings", 2048),
            rope_theta=config.get("rope_theta")
            or rope.get("rope_theta")
            or (config.get("rope_parameters") or {}).get("rope_theta")
            or 10000.0,
            **rope_fields_from_hf(rope, config.get("max_position_embeddings", 2048), source),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qk_norm=qk_norm,
            init_std=config.get("initializer_range", 0.02),
            **moe,
        )
    except ValidationError as e:
        raise UserError(
            f"{source}: its config.json does not describe a valid Forge model: {e.errors()[0]['msg']}",
            "check config.json",
        ) from None
    if moe and architecture != MIXTRAL and cfg.expert_ffn_dim != config["moe_intermediate_size"]:
        raise UserError(
            f"{source}: moe_intermediate_size = {config['moe_intermediate_size']} is not "
            f"round(intermediate_size × m) for any moe_expert_ffn_multiplier m Forge can represent",
            "this expert width cannot be expressed in Forge's [model] section",
        )
    for issue in expert_group_issues(cfg) if cfg.moe_router == "sigmoid_topk" else []:
        raise UserError(f"{source}: n_group / topk_group as {issue.path} = {issue.problem}", issue.hint)
    return cfg


def rope_fields_from_hf(rope: dict[str, Any], max_positions: int, source: str) -> dict[str, Any]:
    """The [model] RoPE scaling fields for transformers' rope parameters (whose type refuse_unsupported
    checked); llama3 without original_max_position_embeddings uses max_position_embeddings, as transformers
    does."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {}
    fields = {"rope_scaling": kind, "rope_scaling_factor": required(rope, "factor", source)}
    if kind == "llama3":
        fields.update(
            rope_low_freq_factor=required(rope, "low_freq_factor", source),
            rope_high_freq_factor=required(rope, "high_freq_factor", source),
            rope_original_max_seq_len=rope.get("original_max_position_embeddings") or max_positions,
        )
    return fields


def sliding_window_from_hf(config: dict[str, Any], architecture: str, source: str) -> int | None:
    """Mistral's sliding_window (4096 when absent, as MistralConfig assumes), or Qwen2's and Qwen3's with
    use_sliding_window when every layer slides; a window on some layers only is refused."""
    if architecture == MISTRAL:
        return config.get("sliding_window", MISTRAL_DEFAULT_WINDOW)
    if architecture not in QWEN_WINDOWED or not config.get("use_sliding_window"):
        return None
    window, layers = config.get("sliding_window", MISTRAL_DEFAULT_WINDOW), required(config, "num_hidden_layers", source)
    kinds = config.get("layer_types") or [
        "sliding_attention" if i >= config.get("max_window_layers", 28) else "full_attention" for i in range(layers)
    ]
    if window is None or set(kinds) == {"full_attention"}:
        return None
    if set(kinds) != {"sliding_attention"}:
        raise UserError(
            f"{source}: config.json slides its attention window on some layers only ({kinds.count('sliding_attention')} "
            f"of {layers}: max_window_layers / layer_types), which Forge's model.sliding_window (every layer) "
            "cannot express",
            "only models whose layers all slide, or none, convert",
        )
    return window


def moe_fields_from_hf(config: dict[str, Any], architecture: str, ffn_dim: int, source: str) -> dict[str, Any]:
    """The MoE fields of the `[model]` section for a Qwen2-MoE/Qwen3-MoE/GLM-4-MoE config.json (whose
    routing `refuse_unsupported` has checked is Forge's)."""
    if architecture == MIXTRAL:  # every block MoE, the experts as wide as intermediate_size
        return {
            "moe_top_k": required(config, "num_experts_per_tok", source),
            "num_experts": required(config, "num_local_experts", source),
            "moe_router": "softmax_topk_renorm",
        }
    layers = required(config, "num_hidden_layers", source)
    fields = {
        "moe_top_k": required(config, "num_experts_per_tok", source),
        "moe_expert_ffn_multiplier": required(config, "moe_intermediate_size", source) / ffn_dim,
    }
    if architecture != GLM4_MOE:
        return {
            **fields,
            # transformers 5 saves Qwen3-MoE's expert count as num_local_experts
            "num_experts": config["num_local_experts"]
            if "num_local_experts" in config
            else required(config, "num_experts", source),
            "moe_router": "softmax_topk_renorm" if config.get("norm_topk_prob") else "softmax_topk",
            "moe_frequency": config.get("decoder_sparse_step", 1),
        }
    first_dense = config.get("first_k_dense_replace", 1)
    if first_dense not in (0, layers - 1):
        raise UserError(
            f"{source}: first_k_dense_replace = {first_dense} gives {first_dense} dense blocks before "
            f"{layers - first_dense} MoE blocks, which Forge's moe_frequency (MoE in every N-th block) "
            "cannot express",
            "only first_k_dense_replace = 0 or num_hidden_layers - 1 converts",
        )
    return {
        **fields,
        "num_experts": required(config, "n_routed_experts", source),
        "moe_router": "sigmoid_topk",
        "moe_shared_experts": config.get("n_shared_experts", 1),
        "moe_frequency": 1 if first_dense == 0 else layers,
        "moe_n_group": config.get("n_group", 1),
        "moe_topk_group": config.get("topk_group", 1),
    }


def read_architecture(config: dict[str, Any], source: str) -> str:
    """The architecture of MODEL_TYPES a config.json describes (the caller found it among them)."""
    model_type = config.get("model_type")
    named = config.get("architectures") or []
    for architecture, expected_type in MODEL_TYPES.items():
        if model_type == expected_type and (not named or architecture in named):
            return architecture
    what = f"model_type {model_type!r}" + (f" ({', '.join(map(str, named))})" if named else "")
    readable = ", ".join(f'{name} (model_type "{kind}")' for name, kind in MODEL_TYPES.items())
    raise UserError(f"{source} holds a {what} model, which Forge cannot load", f"Forge reads {readable} folders")


def refuse_unsupported(config: dict[str, Any], architecture: str, source: str) -> None:
    """Settings of those architectures that Forge's model does not implement."""
    problems = []
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {config['hidden_act']!r} (Forge's gated MLP here needs silu)")
    for bias in ("attention_bias", "mlp_bias"):
        if config.get(bias):
            problems.append(f"{bias} = true (Forge's output projection and MLP have no bias)")
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if (kind := rope.get("rope_type", rope.get("type", "default"))) not in ("default", "linear", "llama3"):
        problems.append(f"RoPE scaling {kind!r} (Forge implements plain RoPE, linear and llama3)")
    if architecture in MOE_ARCHITECTURES and config.get("use_sliding_window"):
        problems.append("use_sliding_window = true in an MoE model (Forge's MoE models attend over the whole context)")
    if architecture in MOE_ARCHITECTURES:
        problems += moe_problems(config, architecture)
    if problems:
        raise UserError(
            f"{source}: config.json asks for what Forge's model does not implement: {'; '.join(problems)}",
            "only configurations Forge computes exactly convert; nothing was written",
        )


def moe_problems(config: dict[str, Any], architecture: str) -> list[str]:
    """Routing settings of the MoE architectures that differ from Forge's routers."""
    problems = []
    if architecture == GLM4_MOE:
        if not config.get("norm_topk_prob", True):
            problems.append("norm_topk_prob = false (Forge's sigmoid_topk router renormalises the top-k scores)")
        for key, wanted in (
            ("routed_scaling_factor", 1.0),
            ("num_nextn_predict_layers", 0),
        ):
            if config.get(key, wanted) != wanted:
                problems.append(f"{key} = {config[key]} (Forge's sigmoid_topk router is the case {key} = {wanted})")
        rope = config.get("rope_parameters") or {}
        rotary = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5))  # GLM's default: 0.5
        if rotary != 1.0:
            problems.append(f"partial_rotary_factor = {rotary} (Forge rotates the whole head)")
        return problems
    if architecture == MIXTRAL:
        if config.get("router_jitter_noise"):
            problems.append(
                f"router_jitter_noise = {config['router_jitter_noise']} (Forge's router does not perturb its input)"
            )
        if config.get("sliding_window") is not None:
            problems.append(f"sliding_window = {config['sliding_window']} (Forge attends over the whole context)")
        return problems
    if config.get("mlp_only_layers"):
        problems.append(
            f"mlp_only_layers = {config['mlp_only_layers']} (Forge places MoE blocks by moe_frequency only)"
        )
    if architecture == QWEN2_MOE and config.get("shared_expert_intermediate_size", 1):
        problems.append(
            f"shared_expert_intermediate_size = {config.get('shared_expert_intermediate_size')} (Qwen2-MoE "
            "gates its shared expert by a learned sigmoid; Forge's shared experts are ungated)"
        )
    return problems


def required(config: dict[str, Any], key: str, source: str) -> Any:
    if key not in config:
        raise UserError(f"{source}: config.json has no {key!r}", "pass a complete Hugging Face model folder")
    return config[key]


def hf_layout(cfg: ModelConfig) -> dict[str, Piece]:
    """HF tensor name → how to make it from the Forge state dict, for every tensor an HF folder of `cfg`
    stores, in model order. A tied head is stored once, as the embedding (transformers ties lm_head to it
    on load)."""
    architecture = hf_architecture(cfg)
    layout = {OUTER_NAMES["tok_embeddings.weight"]: Piece("tok_embeddings.weight")}
    for i in range(cfg.n_layers):
        for ours, theirs in LAYER_NAMES.items():
            if (
                (ours in QK_NORM_NAMES and not cfg.qk_norm)
                or (ours in QKV_BIAS_NAMES and not cfg.attention_qkv_bias)
                or (ours in DENSE_FFN_NAMES and cfg.is_moe_layer(i))
            ):
                continue
            layout[f"model.layers.{i}.{theirs}"] = Piece(f"layers.{i}.{ours}")
        if cfg.is_moe_layer(i):
            layout.update(moe_layout(cfg, architecture, i))
    layout[OUTER_NAMES["norm.weight"]] = Piece("norm.weight")
    if not cfg.tie_embeddings:
        layout[OUTER_NAMES["output.weight"]] = Piece("output.weight")
    return fold_mup_scales(cfg, layout)


def fold_mup_scales(cfg: ModelConfig, layout: dict[str, Piece]) -> dict[str, Piece]:
    """Under μP the model multiplies the queries and the head's input by constants (engine/model/mup.py)
    that the HF classes do not have; both are folded into weights that are linear in them. The query scale
    goes into q_proj, or with QK-norm into q_norm's weight (the norm would undo a scaled q_proj; RoPE is
    linear, so scaling before or after it is the same). The logit multiplier goes into the final norm's
    weight, the head's input, which holds it whether or not the head is tied to the embedding."""
    if cfg.parametrization != "mup":
        return layout
    query = "self_attn.q_norm.weight" if cfg.qk_norm else "self_attn.q_proj.weight"
    scales = {OUTER_NAMES["norm.weight"]: output_multiplier(cfg)}
    scales |= {f"model.layers.{i}.{query}": query_scale(cfg) for i in range(cfg.n_layers)}
    return {name: replace(piece, scale=scales[name]) if name in scales else piece for name, piece in layout.items()}


def moe_layout(cfg: ModelConfig, architecture: str, layer: int) -> dict[str, Piece]:
    """The HF tensors of MoE block `layer`: router, routing bias (sigmoid_topk), experts, shared experts."""
    ours, theirs = f"layers.{layer}.feed_forward", f"model.layers.{layer}.{MOE_MODULE.get(architecture, 'mlp')}"
    layout = {f"{theirs}.gate.weight": Piece(f"{ours}.router.gate.weight")}
    if cfg.moe_router == "sigmoid_topk":
        layout[f"{theirs}.gate.e_score_correction_bias"] = Piece(f"{ours}.router.bias", fp32=True)
    names = {w: w for w in PROJECTIONS} if architecture == MIXTRAL else PROJECTIONS
    for e in range(cfg.num_experts):
        for w, proj in names.items():
            source = f"{ours}.experts.{w}" if cfg.moe_packed_experts else f"{ours}.experts.{e}.{w}"
            layout[f"{theirs}.experts.{e}.{proj}.weight"] = Piece(
                source, expert=e if cfg.moe_packed_experts else None, transpose=True
            )
    if architecture in SHARED:
        shared = f"{theirs}.{SHARED[architecture]}"
        for w, proj in PROJECTIONS.items():
            empty = (cfg.dim, 0) if w == "w2" else (0, cfg.dim)
            layout[f"{shared}.{proj}.weight"] = (
                Piece(f"{ours}.shared.{w}.weight") if cfg.moe_shared_experts else Piece(None, shape=empty)
            )
        if architecture == QWEN2_MOE:  # gates a zero-width expert: its value cannot matter
            layout[f"{theirs}.shared_expert_gate.weight"] = Piece(None, shape=(1, cfg.dim))
    return layout


# One attention layer, Forge "attention.<key>" ↔ HF "self_attn.<value>", for the architectures whose attention
# layer Forge computes while the rest of their model it does not (see hf_architecture): Qwen3-Next's gated
# attention (attention_output_gate with qk_norm; q_proj holds each head's query then its gate, as wq does) and
# GPT-OSS's sink attention (attention_sinks).
ATTENTION_LAYER_NAMES = {
    "wq.weight": "q_proj.weight",
    "wq.bias": "q_proj.bias",
    "wk.weight": "k_proj.weight",
    "wk.bias": "k_proj.bias",
    "wv.weight": "v_proj.weight",
    "wv.bias": "v_proj.bias",
    "wo.weight": "o_proj.weight",
    "q_norm.weight": "q_norm.weight",
    "k_norm.weight": "k_norm.weight",
    "sinks.weight": "sinks",
}
QWEN3_NEXT, GPT_OSS = "Qwen3NextForCausalLM", "GptOssForCausalLM"
# architecture → the norm weights its layer stores zero-centred (x̂ · (1 + weight)): Forge's w is stored as w − 1.
# What else their layers may have and Forge's has not does not map: a tensor (GPT-OSS's default o_proj bias,
# attention_bias = true) is refused by name; a setting (Qwen3-Next's partial RoPE, partial_rotary_factor < 1)
# holds no tensor, and a layer of it computes another rotation than Forge's.
ATTENTION_LAYERS = {QWEN3_NEXT: ("q_norm.weight", "k_norm.weight"), GPT_OSS: ()}


def attention_state_for_hf(state: dict[str, Any], architecture: str) -> dict[str, Any]:
    """One Forge attention layer's tensors (keys relative to the block's `attention.`) as `architecture`'s
    attention layer names and stores them (keys relative to `self_attn.`)."""
    shifted = ATTENTION_LAYERS[architecture]
    return {ATTENTION_LAYER_NAMES[k]: t - 1.0 if k in shifted else t for k, t in state.items()}


def attention_state_from_hf(state: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The inverse of `attention_state_for_hf`: an HF attention layer's tensors as Forge's attention holds them;
    a tensor Forge's attention has no counterpart of (an o_proj bias) is refused, naming it."""
    shifted = ATTENTION_LAYERS[architecture]
    ours = {theirs: key for key, theirs in ATTENTION_LAYER_NAMES.items()}
    unmapped = sorted(set(state) - set(ours))
    if unmapped:
        raise UserError(
            f"{architecture}'s attention layer holds {', '.join(unmapped)}, which Forge's attention has no "
            "counterpart of",
            "only layers without them map (GPT-OSS with attention_bias = false)",
        )
    return {ours[k]: t + 1.0 if ours[k] in shifted else t for k, t in state.items()}


MAPPING = HFMapping(
    model_types=MODEL_TYPES,
    architecture=hf_architecture,
    config=hf_config,
    model_config=model_config_from_hf,
    layout=hf_layout,
    architecture_fields=ARCHITECTURE_FIELDS,
    # A sigmoid router's balancing state: imported as no update pending, none made.
    unstored_state=("router.pending_load", "router.updates"),
    ignored_suffixes=("rotary_emb.inv_freq",),  # buffers some older Llama checkpoints store, derived from the config
    tied_head=OUTER_NAMES["output.weight"],
)
