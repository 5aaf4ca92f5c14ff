"""The metrics sinks Forge ships, each registered once in `METRICS_SINKS` (engine/config/registry.py) with its own
`[metrics]` fields and the sink it starts, named "module:function" so that registering imports nothing but this
module (engine/config/metrics.py imports it to compose `[metrics]`; torch-free, no wandb, no tensorboard).

Every sink that is on receives each logging step's metrics (engine/metrics/trackers.py: `MetricsLogger`); several
are on at once. A sink is on when its switch field is true (`metrics.enable_wandb`), or always when it has none
(`RUN_DIR/metrics.jsonl`, which `forge runs`, `forge resume` and the dashboards read). A field of a sink that is
off, set away from its default, is a config error naming the sink (engine/config/registry.py:
`SinkRegistry.owner_issues`), except the ones a sink keeps while off.

A new sink is its class (`log(step, metrics)`, `close()`; in engine/metrics/trackers.py or a module of its own), a
function that starts it from `(its config, SinkContext)`, and a config class of its own fields decorated with
`@METRICS_SINKS.register(NAME, build="module:function", switch="enable_NAME")`, here or in a module this one
imports.
"""

from __future__ import annotations

from pydantic import Field

from engine.config.base import Section
from engine.config.registry import METRICS_SINKS

METRICS_SINKS.register("jsonl", build="engine.metrics.trackers:start_jsonl")(Section)


@METRICS_SINKS.register(
    "wandb",
    build="engine.metrics.trackers:start_wandb",
    switch="enable_wandb",
    kept_while_off=("wandb_project", "wandb_run_name", "wandb_run_id"),
)
class WandbFields(Section):
    """Weights & Biases: the run the metrics go to. Its run's name and id may stay in a config with W&B off (a
    preset names the run that `--metrics.enable_wandb=true` logs into; a run directory's saved config keeps it)."""

    enable_wandb: bool = Field(False, description="log metrics to Weights & Biases (needs the wandb extra)")
    wandb_project: str = Field("forge", description="the W&B project the run is logged to")
    wandb_run_name: str | None = Field(None, description="unset = the run directory's name")
    wandb_run_id: str | None = Field(
        None,
        description="log into (resume) the W&B run with this id; unset = a new run, or on resume the run "
        "the checkpoint recorded",
    )


@METRICS_SINKS.register("tensorboard", build="engine.metrics.trackers:start_tensorboard", switch="enable_tensorboard")
class TensorBoardFields(Section):
    """TensorBoard event files."""

    enable_tensorboard: bool = Field(False, description="write TensorBoard event files (needs the tensorboard extra)")
    tensorboard_dir: str | None = Field(
        None, description="unset = RUN_DIR/tensorboard; relative = inside the run directory"
    )
