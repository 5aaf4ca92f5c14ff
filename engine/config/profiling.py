"""`[profiling]`: a torch.profiler window written as a Chrome/Perfetto trace."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from engine.config.base import Section


class ProfilingConfig(Section):
    enable: bool = Field(False, description="record a torch.profiler trace of the steps start_step … end_step")
    start_step: int = Field(5, gt=0, description="first profiled step")
    end_step: int = Field(7, gt=0, description="last profiled step")
    trace_dir: str = Field(
        "profile",
        description="where the traces are written, one per process (trace_steps_A-B_rankR.json); relative paths "
        "are inside the run directory",
    )

    readers: ClassVar[dict[str, str]] = {
        "enable": "train/profiling.py",
        "start_step": "train/profiling.py",
        "end_step": "train/profiling.py",
        "trace_dir": "train/profiling.py",
    }
    """The engine modules (under engine/) that read each field: the "read by" column of docs/configuration.md."""

    @model_validator(mode="after")
    def _window(self) -> ProfilingConfig:
        if self.end_step < self.start_step:
            raise ValueError(f"end_step ({self.end_step}) must be >= start_step ({self.start_step})")
        return self
