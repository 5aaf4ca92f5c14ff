"""A torch.profiler window over a few steps, exported as a Chrome/Perfetto trace: a loop callback."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import ProfilerActivity, profile

from engine.config.profiling import ProfilingConfig
from engine.train.callbacks.base import PRIORITY, Callback

if TYPE_CHECKING:
    from engine.train.step import StepResult
    from engine.train.trainer import TrainLoop


class ProfilerWindow(Callback):
    """Records steps start_step..end_step (inclusive) when enabled; writes TRACE_DIR/trace_steps_A-B_rankR.json,
    where A..B is what this process recorded (a run resumed inside the window records the rest of it) and R
    its rank: every process profiles its own work, and each keeps its own file (one shared name had the
    ranks' exports replace each other's, or fail). First in each event's order: the window holds the steps
    from their first micro-batch to their update, not the other callbacks' work after it."""

    name = "profiling"
    priority = PRIORITY["profiling"]
    failure_saves = False

    def __init__(self, cfg: ProfilingConfig, run_dir: Path, device: torch.device, rank: int) -> None:
        self.cfg = cfg
        self.trace_dir = run_dir / cfg.trace_dir
        self.rank = rank
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profiler = profile(activities=activities, record_shapes=True) if cfg.enable else None
        self.started_at: int | None = None  # first recorded step while recording

    def before_step(self, step: int, loop: TrainLoop) -> None:
        """A run resumed inside the window starts recording at its first step there."""
        if self.profiler is not None and self.started_at is None and self.cfg.start_step <= step <= self.cfg.end_step:
            self.profiler.start()
            self.started_at = step

    def after_optimizer_step(self, step: int, result: StepResult, loop: TrainLoop) -> None:
        if self.started_at is not None and step == self.cfg.end_step:
            self.export(step)

    def on_end(self, summary: dict[str, Any], loop: TrainLoop) -> None:
        """A run that ends inside the window still writes what it recorded."""
        if self.started_at is not None:
            self.export(summary["steps"])

    def export(self, step: int) -> None:
        self.profiler.stop()
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        name = f"trace_steps_{self.started_at}-{step}_rank{self.rank}.json"
        self.profiler.export_chrome_trace(str(self.trace_dir / name))
        self.started_at = None
