"""The rules of the metrics sinks (engine/metrics/): a sink's own fields only where the sink is on.

Torch-free, like every room's rules module: it imports engine.config's registry, `JobConfig` for its types alone;
engine/plan/checks.py runs it in the order it lists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config.registry import METRICS_SINKS
from engine.errors import ConfigIssue

if TYPE_CHECKING:
    from engine.config.job import JobConfig


def sink_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """A field of a sink that is off, set away from its default, names the sink (engine/metrics/sinks.py says
    which fields a sink keeps while off)."""
    return METRICS_SINKS.owner_issues("metrics", cfg.metrics)
