"""Which config changes a run may take when it resumes.

A resumed run must continue the same computation: the model's shape, the data and its order, and the
optimization all come from the saved config. Only fields that do not change what is computed, or that
extend it (train.max_steps, max_epochs, max_tokens), may differ; so may `train.hooks` (a hook that stopped a run can be fixed or
dropped on resume). The layout may change too (`distributed.*`, and the per-device
`train.batch_size` and `grad_accum_steps`) as long as the global batch stays the same: the trainer checks
that against the checkpoint's tokens per step, since it depends on the world size. The `[data]` fields may
change (data moved, a Hub revision pinned after the fact) because the trainer checks the data itself against
the checkpoint: the same tokenizer and the same shards, or the resume is refused.
"""

from __future__ import annotations

from typing import Any

from engine.config.job import JobConfig
from engine.errors import ConfigIssue

SAFE_ON_RESUME = (
    "train.max_steps",
    "train.max_epochs",  # like max_steps, it says how long (and a resume derives the steps from the same data)
    "train.max_tokens",
    "train.global_batch_size",  # the trainer checks the global batch itself, as for batch_size
    "train.compile_model",
    "train.activation_checkpointing",
    "train.activation_offload",  # where saved activations wait changes no value (tests/train/test_memory_options.py)
    "train.shutdown_timeout_sec",
    "train.nccl_health_check_interval",
    "train.max_rollbacks",
    "train.hooks",
    "train.ema_",  # the EMA only watches the weights; turned on later, it starts from the restored ones
    "train.batch_size",
    "train.grad_accum_steps",
    "distributed.",
    "data.",
    "checkpoint.interval",
    "checkpoint.interval_minutes",
    "checkpoint.keep_last_n",
    "checkpoint.keep",
    "checkpoint.async_mode",
    "checkpoint.export_dtype",  # read by forge convert, never by training
    "eval.",
    "metrics.",
    "profiling.",
)


def flatten(cfg: JobConfig) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, fields in cfg.model_dump().items() for key, value in fields.items()}


def resume_issues(saved: JobConfig, new: JobConfig) -> list[ConfigIssue]:
    """One issue per field that differs from the saved run and may not change on resume."""
    before, after = flatten(saved), flatten(new)
    return [
        ConfigIssue(
            path,
            f"the run was trained with {before[path]!r}, not {after[path]!r}",
            "keep the run's value (forge resume RUN_DIR continues with the run's config; add "
            "--train.max_steps=N to train longer), or train into a new --run-dir",
        )
        for path in before
        if before[path] != after[path] and not path.startswith(SAFE_ON_RESUME)
    ]
