"""How the GPT-2 family corresponds to `transformers`' GPT2LMHeadModel, both ways (torch-free:
engine/checkpoint/hf_mapping.py and hf.py move the tensors).

GPT-2's checkpoints store every linear as a Conv1D, [in, out] (the transpose of nn.Linear's [out, in]), and
fuse each block's q, k and v projections into one `attn.c_attn` ([dim, 3·dim] weight, [3·dim] bias, q then k
then v along the output features). Forge keeps separate wq/wk/wv, so that tensor parallelism shards whole
heads of each; the mapping says so with a fused `Piece` (engine/model/spec.py): exported as the
concatenation of the three, imported split into three equal parts. Older checkpoints also store each
block's causal-mask buffers (`attn.bias`, `attn.masked_bias`), derived and skipped on import.

Only configurations Forge computes exactly are read: the tanh-approximated GELU (`gelu_new`, or the same
function as `gelu_pytorch_tanh`), attention scaled by 1/√head_dim and not by layer, no cross-attention.
Dropout probabilities are accepted and not kept: Forge trains without dropout, and transformers applies none
in evaluation.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from engine.config.fields import changed_fields
from engine.config.model import ModelConfig
from engine.config.registry import MODELS
from engine.errors import UserError
from engine.model.spec import HFMapping, Piece

GPT2 = "GPT2LMHeadModel"
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")  # both 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
ARCHITECTURE_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "vocab_size",
    "ffn_dim",
    "norm_eps",
    "max_seq_len",
    "tie_embeddings",
)

# Inside block i: Forge "layers.{i}.<key>" ↔ HF "transformer.h.{i}.<value>" (Conv1D weights transposed).
LAYER_NAMES = {
    "attention_norm.weight": "ln_1.weight",
    "attention_norm.bias": "ln_1.bias",
    "attention.wo.weight": "attn.c_proj.weight",
    "attention.wo.bias": "attn.c_proj.bias",
    "ffn_norm.weight": "ln_2.weight",
    "ffn_norm.bias": "ln_2.bias",
    "feed_forward.w1.weight": "mlp.c_fc.weight",
    "feed_forward.w1.bias": "mlp.c_fc.bias",
    "feed_forward.w2.weight": "mlp.c_proj.weight",
    "feed_forward.w2.bias": "mlp.c_proj.bias",
}


def hf_architecture(cfg: ModelConfig) -> str:
    """GPT2LMHeadModel computes every gpt2 config that leaves the fields GPT-2 has no use for at their
    defaults (as config validation makes every run's config do)."""
    refused = changed_fields(cfg, MODELS.foreign_fields("gpt2"))
    if refused:
        raise UserError(
            f"model.{refused[0]} is set, but model.model_type = 'gpt2' has no such setting, so no "
            "GPT2LMHeadModel computes this config",
            f"remove {', '.join(f'model.{name}' for name in refused)} from the checkpoint's config",
        )
    return GPT2


def hf_config(cfg: ModelConfig, dtype_name: str, eos_id: int | None, bos_id: int | None) -> dict[str, Any]:
    """config.json of a GPT2LMHeadModel computing `cfg`, weights in `dtype_name`; dropout off (Forge's model
    has none)."""
    config: dict[str, Any] = {
        "architectures": [GPT2],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_embd": cfg.dim,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.ffn_dim,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": dtype_name,
        "use_cache": True,
        "bos_token_id": bos_id,
    }
    if eos_id is not None:
        config["eos_token_id"] = eos_id
    return config


def model_config_from_hf(config: dict[str, Any], source: str) -> ModelConfig:
    """The `[model]` section that computes what a GPT-2 config.json describes, or a UserError naming what
    Forge's GPT-2 does not implement."""
    problems = []
    if config.get("activation_function", "gelu_new") not in TANH_GELUS:
        problems.append(f"activation_function = {config['activation_function']!r} (Forge's GPT-2 uses gelu_new)")
    for key, wanted in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if config.get(key, wanted) != wanted:
            problems.append(f"{key} = {config[key]} (Forge's GPT-2 is the case {key} = {wanted})")
    if problems:
        raise UserError(
            f"{source}: config.json asks for what Forge's GPT-2 does not implement: {'; '.join(problems)}",
            "only configurations Forge computes exactly convert; nothing was written",
        )
    dim = required(config, "n_embd", source)
    try:
        return ModelConfig(
            model_type="gpt2",
            dim=dim,
            n_layers=required(config, "n_layer", source),
            n_heads=required(config, "n_head", source),
            vocab_size=required(config, "vocab_size", source),
            ffn_hidden_dim=config.get("n_inner"),  # None: GPT-2's 4 · dim
            norm_eps=config.get("layer_norm_epsilon", 1e-5),
            max_seq_len=required(config, "n_positions", source),
            tie_embeddings=config.get("tie_word_embeddings", True),
            init_std=config.get("initializer_range", 0.02),
        )
    except ValidationError as e:
        raise UserError(f"{source}: config.json describes an invalid model ({e})", "check config.json") from None


def required(config: dict[str, Any], key: str, source: str) -> Any:
    if key not in config:
        raise UserError(f"{source}: config.json has no {key!r}", "pass a complete Hugging Face model folder")
    return config[key]


def hf_layout(cfg: ModelConfig) -> dict[str, Piece]:
    """HF tensor name → how to make it from the Forge state dict, in model order. A tied head is stored once,
    as the token embedding (transformers ties lm_head to it on load)."""
    layout = {
        "transformer.wte.weight": Piece("tok_embeddings.weight"),
        "transformer.wpe.weight": Piece("pos_embeddings.weight"),
    }
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"transformer.h.{i}"
        for kind in ("weight", "bias"):
            q, k, v = (f"{ours}.attention.{w}.{kind}" for w in ("wq", "wk", "wv"))
            layout[f"{theirs}.attn.c_attn.{kind}"] = Piece(q, fused=(k, v), transpose=kind == "weight")
        for forge, hf in LAYER_NAMES.items():
            conv1d_weight = hf.endswith(".weight") and not hf.startswith("ln_")
            layout[f"{theirs}.{hf}"] = Piece(f"{ours}.{forge}", transpose=conv1d_weight)
    layout["transformer.ln_f.weight"] = Piece("norm.weight")
    layout["transformer.ln_f.bias"] = Piece("norm.bias")
    if not cfg.tie_embeddings:
        layout["lm_head.weight"] = Piece("output.weight")
    return layout


MAPPING = HFMapping(
    model_types={GPT2: "gpt2"},
    architecture=hf_architecture,
    config=hf_config,
    model_config=model_config_from_hf,
    layout=hf_layout,
    architecture_fields=ARCHITECTURE_FIELDS,
    ignored_suffixes=(".attn.bias", ".attn.masked_bias"),  # causal-mask buffers of older GPT-2 checkpoints
    tied_head="lm_head.weight",
    base_model_prefix="transformer.",  # OpenAI's checkpoints on the Hub name their tensors without it
)
