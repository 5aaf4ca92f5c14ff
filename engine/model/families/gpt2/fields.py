"""The `[model]` fields GPT-2 has no use for (torch-free): its norms are always LayerNorm, its MLP is GELU and
not gated, its heads all have their own keys and values, its positions are learned (no RoPE), it has no QK-norm
and no experts, and μP's scales are not wired into its modules. Config validation refuses a gpt2 config that sets one away from its default
(engine/model/rules.py: family_issues), and the export refuses a checkpoint config that does."""

from __future__ import annotations

from engine.config.model import MOE_FIELDS

REFUSED_FIELDS = (
    "n_kv_heads",
    "ffn_dim_multiplier",
    "norm_type",
    "activation",
    "rope_theta",
    "qk_norm",
    "attention_head_dim",
    "attention_qkv_bias",  # every GPT-2 linear has a bias already
    "rope_scaling",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_seq_len",
    "sliding_window",
    "parametrization",  # μP (engine/model/mup.py) is wired into the transformer family only
    "mup_base_dim",
    "num_experts",
    *MOE_FIELDS,
)
