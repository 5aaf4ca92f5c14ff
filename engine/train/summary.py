"""What a job will cost, computed from its config alone (no torch): shown by validate-config and train."""

from __future__ import annotations

from typing import Any

from engine.config.job import JobConfig
from engine.data.batch_plan import batch_plan
from engine.model import mup
from engine.model.estimate import param_counts, training_flops_per_token
from engine.train.length import in_recipe_terms, length_summary, with_derived_length


def job_summary(cfg: JobConfig, world_size: int = 1) -> dict[str, Any]:
    """A validated `cfg` (its lengths are derived here, engine/train/length.py, where they are not yet).
    tokens_per_step is the full global batch's; total_tokens counts a batch ramp's smaller steps as they are."""
    cfg = with_derived_length(cfg, world_size)
    dp = cfg.distributed.dp_replicate * cfg.distributed.resolved_dp_shard(world_size)
    tokens_per_step = cfg.tokens_per_step(world_size)
    flops_per_token = training_flops_per_token(cfg.model, cfg.train.seq_len)
    return {
        "world_size": world_size,
        "data_parallel": max(dp, 1),
        "parameters": param_counts(cfg.model),
        "flops_per_token": flops_per_token,
        "tokens_per_step": tokens_per_step,
        "flops_per_step": flops_per_token * tokens_per_step,
        "total_tokens": batch_plan(cfg, world_size).tokens_before(cfg.train.max_steps),
        **({"length": length_summary(cfg, world_size)} if in_recipe_terms(cfg) else {}),
        **({"mup": mup.summary(cfg.model)} if cfg.model.parametrization == "mup" else {}),
    }
