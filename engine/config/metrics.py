"""`[metrics]`: logging cadence and sinks."""

from __future__ import annotations

from pydantic import Field

from engine.config.base import Section


class MetricsConfig(Section):
    log_interval: int = Field(10, gt=0, description="log every N steps (and the last)")
    enable_wandb: bool = False
    enable_tensorboard: bool = False
    wandb_project: str = "forge"
    wandb_run_name: str | None = Field(None, description="unset = the run directory's name")
    tensorboard_dir: str | None = Field(
        None, description="unset = RUN_DIR/tensorboard; relative = inside the run directory"
    )
