"""`[profiling]`: a torch.profiler window written as a Chrome/Perfetto trace."""

from __future__ import annotations

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

    @model_validator(mode="after")
    def _window(self) -> ProfilingConfig:
        if self.end_step < self.start_step:
            raise ValueError(f"end_step ({self.end_step}) must be >= start_step ({self.start_step})")
        return self
