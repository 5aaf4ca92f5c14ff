"""Where training metrics go: always `RUN_DIR/metrics.jsonl`, plus TensorBoard and W&B when enabled.

Build one `MetricsLogger` in the process that reports (rank 0 of a distributed run) and call `log` at each
logging step. A value of None means "not available" (MFU on a GPU missing from the peak table): it is
null in the JSONL file and skipped by TensorBoard and W&B. A `step` key among the metrics is the x-axis,
not a series.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Mapping, Protocol

from engine.config.job import JobConfig
from engine.errors import UserError

METRICS_FILE = "metrics.jsonl"


class Sink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float | None]) -> None: ...

    def close(self) -> None: ...


class MetricsLogger:
    """Fans each `log` call out to every sink; usable as a context manager so sinks close on errors too."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def build_trackers(cfg: JobConfig, run_dir: str | Path, run_name: str | None = None) -> MetricsLogger:
    """The sinks `cfg.metrics` asks for, writing under `run_dir`.

    `run_name` names the W&B run when `metrics.wandb_run_name` is unset (default: the run directory's name).
    """
    run_dir = Path(run_dir)
    m = cfg.metrics
    sinks: list[Sink] = []
    try:
        sinks.append(JsonlSink(run_dir / METRICS_FILE))
        if m.enable_tensorboard:
            sinks.append(TensorBoardSink(run_dir / (m.tensorboard_dir or "tensorboard")))
        if m.enable_wandb:
            sinks.append(WandbSink(cfg, run_dir, m.wandb_run_name or run_name or run_dir.name))
    except BaseException:
        MetricsLogger(sinks).close()
        raise
    return MetricsLogger(sinks)


class JsonlSink:
    """One JSON object per call, `{"step", "time", **metrics}`, flushed at once so a crash loses no line.

    Non-finite floats (a diverged loss) are written as null, keeping every line standard JSON.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        record = {"step": step, "time": time.time(), **{k: finite_or_none(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record, allow_nan=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def series(metrics: Mapping[str, float | None]) -> dict[str, float]:
    """What TensorBoard and W&B plot: every available value except the step itself."""
    return {k: v for k, v in metrics.items() if v is not None and k != "step"}


def finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


class TensorBoardSink:
    """Scalars through torch's SummaryWriter."""

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("metrics.enable_tensorboard = true but tensorboard is not installed",
                            "pip install tensorboard (or 'forge-lm[tracking]'), "
                            "or set metrics.enable_tensorboard = false") from None
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        for key, value in series(metrics).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in `run_dir/wandb` with the resolved config; `WANDB_MODE=offline` logs locally (`wandb sync`).

    Metrics are plotted against an explicit `step` metric, the training step.
    """

    def __init__(self, cfg: JobConfig, run_dir: Path, name: str) -> None:
        try:
            import wandb
        except ImportError:
            raise UserError("metrics.enable_wandb = true but wandb is not installed",
                            "pip install wandb (or 'forge-lm[tracking]'), "
                            "or set metrics.enable_wandb = false") from None
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(project=cfg.metrics.wandb_project, name=name, dir=run_dir,
                                  config=cfg.model_dump(mode="json"))
        except wandb.errors.Error as e:
            raise UserError(f"W&B could not start a run: {e}",
                            "run `wandb login`, or set WANDB_MODE=offline to log locally, "
                            "or set metrics.enable_wandb = false") from None
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        self.run.log({**series(metrics), "step": step})

    def close(self) -> None:
        self.run.finish()
