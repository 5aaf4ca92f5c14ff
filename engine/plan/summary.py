"""What a job will cost, computed from its resolved plan alone (no torch): shown by validate-config and train."""

from __future__ import annotations

from typing import Any

from engine.model import mup
from engine.plan.job import ResolvedJob
from engine.plan.length import in_recipe_terms, length_summary


def job_summary(job: ResolvedJob) -> dict[str, Any]:
    """tokens_per_step is the full global batch's; total_tokens counts a batch ramp's smaller steps as they are."""
    cfg = job.config
    return {
        "world_size": job.world_size,
        "data_parallel": job.data_parallel,
        "parameters": job.parameters,
        "flops_per_token": job.flops_per_token,
        "tokens_per_step": job.tokens_per_step,
        "flops_per_step": job.flops_per_step,
        "total_tokens": job.total_tokens,
        **({"length": length_summary(cfg, job.world_size)} if in_recipe_terms(cfg) else {}),
        **({"mup": mup.summary(cfg.model)} if cfg.model.parametrization == "mup" else {}),
    }
