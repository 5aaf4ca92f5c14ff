"""`[checkpoint]`: where and how often DCP checkpoints are written."""

from __future__ import annotations

from pydantic import Field

from engine.config.base import Section


class CheckpointConfig(Section):
    dir: str = Field("checkpoints", description="checkpoint folder; relative paths are inside the run directory")
    interval: int | None = Field(None, gt=0, description="save every N steps; a final checkpoint is always written")
    keep_last_n: int | None = Field(None, gt=0, description="delete older step_N checkpoints; unset = keep all")
