"""A torch.profiler window over a few steps, exported as a Chrome/Perfetto trace."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity, profile

from engine.config.profiling import ProfilingConfig


class ProfilerWindow:
    """Records steps start_step..end_step (inclusive) when enabled; writes TRACE_DIR/trace_steps_A-B.json."""

    def __init__(self, cfg: ProfilingConfig, run_dir: Path, device: torch.device) -> None:
        self.cfg = cfg
        self.trace_dir = run_dir / cfg.trace_dir
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profiler = profile(activities=activities, record_shapes=True) if cfg.enable else None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if self.profiler is not None and step == self.cfg.start_step:
            self.profiler.start()
        try:
            yield
        finally:
            if self.profiler is not None and step == self.cfg.end_step:
                self.profiler.stop()
                self.trace_dir.mkdir(parents=True, exist_ok=True)
                self.profiler.export_chrome_trace(str(self.trace_dir / f"trace_steps_{self.cfg.start_step}-{step}.json"))
