"""How a dense Forge model corresponds to a Hugging Face `transformers` architecture, both ways.

Forge's block is the Llama block: RMSNorm, RoPE in the rotate-half layout (so q/k weights need no
permutation), grouped-query attention without biases, and a SwiGLU MLP. With `qk_norm` it is the Qwen3
block instead (the same, plus an RMSNorm over each head's queries and keys before RoPE, with the model's
norm eps). Anything else (LayerNorm, GeGLU/ReGLU) has no equivalent there and is refused, never exported
under a name that would compute something different.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import ValidationError

from engine.config.model import ModelConfig
from engine.errors import UserError

LLAMA, QWEN3 = "LlamaForCausalLM", "Qwen3ForCausalLM"
MODEL_TYPES = {LLAMA: "llama", QWEN3: "qwen3"}

# Inside block i: Forge "layers.{i}.<key>" ↔ HF "model.layers.{i}.<value>".
LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
QK_NORM_NAMES = ("attention.q_norm.weight", "attention.k_norm.weight")
OUTER_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
# Fields that decide what the weights compute; a model and an HF folder must agree on all of them.
ARCHITECTURE_FIELDS = ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "ffn_dim", "norm_type", "norm_eps",
                       "activation", "rope_theta", "tie_embeddings", "qk_norm")


def hf_architecture(cfg: ModelConfig) -> str:
    """The `transformers` class that computes exactly what `cfg` does, or a UserError naming the field."""
    if cfg.num_experts:
        raise UserError(f"model.num_experts = {cfg.num_experts}: mixture-of-experts models do not export to Hugging "
                        "Face yet", "only dense models (model.num_experts = 0) export to Hugging Face")
    if cfg.norm_type != "rmsnorm":
        raise UserError(f"model.norm_type = {cfg.norm_type!r} has no equivalent in transformers' Llama/Qwen3 models "
                        "(they use RMSNorm)", "only models trained with norm_type = \"rmsnorm\" export to Hugging Face")
    if cfg.activation != "silu":
        raise UserError(f"model.activation = {cfg.activation!r} has no equivalent in transformers' Llama/Qwen3 models "
                        "(their MLP is SwiGLU)", "only models trained with activation = \"silu\" export to Hugging Face")
    return QWEN3 if cfg.qk_norm else LLAMA


def hf_config(cfg: ModelConfig, torch_dtype: torch.dtype, eos_id: int | None) -> dict[str, Any]:
    """config.json for `cfg`. RoPE's base is written both the transformers 4 way (rope_theta) and the
    transformers 5 way (rope_parameters), so either version reads the same model."""
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
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "torch_dtype": str(torch_dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if architecture == LLAMA:
        config["mlp_bias"] = False
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    # Forge trains each document right after an end-of-text token, which so also starts one; without an
    # explicit value transformers would take its default start token, an arbitrary id in our vocabulary.
    config["bos_token_id"] = eos_id
    if eos_id is not None:
        config["eos_token_id"] = eos_id
    return config


def model_config_from_hf(config: dict[str, Any], source: str) -> ModelConfig:
    """The `[model]` section that computes what an HF Llama/Qwen3 config.json describes; anything Forge's
    model cannot reproduce exactly (other architectures, biases, RoPE scaling, ...) is a UserError."""
    architecture = read_architecture(config, source)
    refuse_unsupported(config, architecture, source)
    heads = required(config, "num_attention_heads", source)
    dim = required(config, "hidden_size", source)
    head_dim = config.get("head_dim") or dim // heads
    if head_dim * heads != dim:
        raise UserError(f"{source}: head_dim ({head_dim}) × num_attention_heads ({heads}) != hidden_size ({dim})",
                        "Forge's attention uses head_dim = hidden_size / num_attention_heads")
    rope = config.get("rope_parameters") or {}
    try:
        return ModelConfig(
            dim=dim, n_layers=required(config, "num_hidden_layers", source), n_heads=heads,
            n_kv_heads=config.get("num_key_value_heads") or heads, vocab_size=required(config, "vocab_size", source),
            ffn_hidden_dim=required(config, "intermediate_size", source), norm_type="rmsnorm",
            norm_eps=config.get("rms_norm_eps", 1e-6), activation="silu",
            max_seq_len=config.get("max_position_embeddings", 2048),
            rope_theta=config.get("rope_theta") or rope.get("rope_theta") or 10000.0,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)), qk_norm=architecture == QWEN3,
            init_std=config.get("initializer_range", 0.02))
    except ValidationError as e:
        raise UserError(f"{source}: its config.json does not describe a valid Forge model: "
                        f"{e.errors()[0]['msg']}", "check config.json") from None


def read_architecture(config: dict[str, Any], source: str) -> str:
    model_type = config.get("model_type")
    named = config.get("architectures") or []
    for architecture, expected_type in MODEL_TYPES.items():
        if model_type == expected_type and (not named or architecture in named):
            return architecture
    what = f"model_type {model_type!r}" + (f" ({', '.join(map(str, named))})" if named else "")
    raise UserError(f"{source} holds a {what} model, which Forge cannot load",
                    f"Forge reads dense {LLAMA} (model_type \"llama\") and {QWEN3} (model_type \"qwen3\") folders")


def refuse_unsupported(config: dict[str, Any], architecture: str, source: str) -> None:
    """Settings of those architectures that Forge's model does not implement."""
    problems = []
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {config['hidden_act']!r} (Forge's gated MLP here needs silu)")
    for bias in ("attention_bias", "mlp_bias"):
        if config.get(bias):
            problems.append(f"{bias} = true (Forge's projections have no bias)")
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        problems.append(f"RoPE scaling {rope.get('rope_type', rope.get('type'))!r} (Forge implements plain RoPE)")
    if architecture == QWEN3 and config.get("use_sliding_window"):
        problems.append("use_sliding_window = true (Forge attends over the whole context)")
    if problems:
        raise UserError(f"{source}: config.json asks for what Forge's model does not implement: {'; '.join(problems)}",
                        "only plain Llama/Qwen3 models convert exactly; nothing was written")


def required(config: dict[str, Any], key: str, source: str) -> Any:
    if key not in config:
        raise UserError(f"{source}: config.json has no {key!r}", "pass a complete Hugging Face model folder")
    return config[key]


def check_same_architecture(model_cfg: ModelConfig, hf_cfg: ModelConfig, source: str) -> None:
    """A model about to receive `source`'s weights must compute what they were trained for."""
    for field in ARCHITECTURE_FIELDS:
        ours, theirs = getattr(model_cfg, field), getattr(hf_cfg, field)
        if ours != theirs:
            raise UserError(f"model.{field} = {ours!r}, but the Hugging Face model in {source} has {theirs!r}",
                            f"set model.{field} = {theirs!r} (`forge convert from-hf` prints the matching [model] section)")


def weight_names(cfg: ModelConfig) -> dict[str, str]:
    """Forge FQN → HF tensor name for every tensor an HF folder of `cfg` stores, in model order. A tied
    head is stored once, as the embedding (transformers ties lm_head to it on load)."""
    names = {"tok_embeddings.weight": OUTER_NAMES["tok_embeddings.weight"]}
    for i in range(cfg.n_layers):
        for ours, theirs in LAYER_NAMES.items():
            if ours in QK_NORM_NAMES and not cfg.qk_norm:
                continue
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    names["norm.weight"] = OUTER_NAMES["norm.weight"]
    if not cfg.tie_embeddings:
        names["output.weight"] = OUTER_NAMES["output.weight"]
    return names


def expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Forge FQN → shape, from the model itself built on the meta device (no memory, no init cost)."""
    from engine.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: tensor.shape for name, tensor in model.state_dict().items()}
