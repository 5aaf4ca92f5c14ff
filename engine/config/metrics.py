"""`[metrics]`: logging cadence and sinks."""

from __future__ import annotations

from pydantic import Field

from engine.config.base import Section


class MetricsConfig(Section):
    log_interval: int = Field(10, gt=0, description="log every N steps (and the last)")
    enable_wandb: bool = Field(False, description="log metrics to Weights & Biases (needs the wandb extra)")
    enable_tensorboard: bool = Field(False, description="write TensorBoard event files (needs the tensorboard extra)")
    wandb_project: str = Field("forge", description="the W&B project the run is logged to")
    wandb_run_name: str | None = Field(None, description="unset = the run directory's name")
    wandb_run_id: str | None = Field(
        None,
        description="log into (resume) the W&B run with this id; unset = a new run, or on resume the run "
        "the checkpoint recorded",
    )
    tensorboard_dir: str | None = Field(
        None, description="unset = RUN_DIR/tensorboard; relative = inside the run directory"
    )
