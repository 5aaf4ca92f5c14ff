"""`[metrics]`: logging cadence and sinks.

`log_interval` is every sink's; each sink's own fields (its switch, `enable_NAME`, among them) are declared by its
config class (engine/metrics/sinks.py, registered in `METRICS_SINKS`), and `MetricsConfig`, the `[metrics]` table,
is composed of them all (engine/config/registry.py: `SinkRegistry`).
"""

from __future__ import annotations

from pydantic import Field

from engine.config.base import Section
from engine.config.registry import METRICS_SINKS


class MetricsFields(Section):
    """The fields every sink reads."""

    log_interval: int = Field(10, gt=0, description="log every N steps (and the last)")


class MetricsConfig(MetricsFields):
    """The `[metrics]` table: the shared fields and every registered sink's own ones (composed by
    `METRICS_SINKS.bind` below; the sinks that are on: `METRICS_SINKS.enabled(cfg)`)."""


LISTED = (
    "log_interval",
    "enable_wandb",
    "enable_tensorboard",
    "wandb_project",
    "wandb_run_name",
    "wandb_run_id",
    "tensorboard_dir",
)
"""The order the resolved `[metrics]` has always listed its keys in (`forge validate-config`, every saved
config.toml; the validate goldens pin it): the two switches first. A sink registered later adds its fields after."""

import engine.metrics.sinks  # noqa: E402, F401  (registers every sink's fields: torch-free)

METRICS_SINKS.bind(MetricsConfig, MetricsFields, order=LISTED)
