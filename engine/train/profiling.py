"""A torch.profiler window over a few steps, exported as a Chrome/Perfetto trace."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from engine.config.profiling import ProfilingConfig


class ProfilerWindow:
    """Records steps start_step..end_step (inclusive) when enabled; writes TRACE_DIR/trace_steps_A-B_rankR.json,
    where A..B is what this process recorded (a run resumed inside the window records the rest of it) and R
    its rank: every process profiles its own work, and each keeps its own file (one shared name had the
    ranks' exports replace each other's, or fail)."""

    def __init__(self, cfg: ProfilingConfig, run_dir: Path, device: torch.device, rank: int) -> None:
        self.cfg = cfg
        self.trace_dir = run_dir / cfg.trace_dir
        self.rank = rank
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profiler = profile(activities=activities, record_shapes=True) if cfg.enable else None
        self.started_at: int | None = None  # first recorded step while recording

    def close(self, step: int) -> None:
        """A run that ends inside the window still writes what it recorded."""
        if self.started_at is not None:
            self.export(step)

    def export(self, step: int) -> None:
        self.profiler.stop()
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        name = f"trace_steps_{self.started_at}-{step}_rank{self.rank}.json"
        self.profiler.export_chrome_trace(str(self.trace_dir / name))
        self.started_at = None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """A run resumed inside the window starts recording at its first step there."""
        if self.profiler is not None and self.started_at is None and self.cfg.start_step <= step <= self.cfg.end_step:
            self.profiler.start()
            self.started_at = step
        try:
            yield
        finally:
            if self.started_at is not None and step == self.cfg.end_step:
                self.export(step)
