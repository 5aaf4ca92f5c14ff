"""Analytic parameter and FLOP counts from a `ModelConfig`, without torch (used by `validate-config`), as the
model's family computes them (its `ModelSpec`).

The model's own `num_parameters()` must equal `param_counts(cfg)["total"]`; a test holds them together.
"""

from __future__ import annotations

from engine.config.model import ModelConfig
from engine.model.spec import spec_for


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """embedding (the input table), output_head (0 when tied), blocks (+ final norm), total, non_embedding,
    and active: the parameters one token runs through (= total for a dense model; for MoE, only top_k
    routed experts per MoE block count)."""
    return spec_for(cfg).param_counts(cfg)


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward + backward FLOPs per token of the active matmuls and of attention, as the family counts
    them (for MoE only the active experts, so MFU measures the work actually done)."""
    return spec_for(cfg).flops_per_token(cfg, seq_len)
