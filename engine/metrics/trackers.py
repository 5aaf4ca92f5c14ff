"""Where training metrics go: always `RUN_DIR/metrics.jsonl`, plus TensorBoard and W&B when enabled (the sinks
and their fields are registered in engine/metrics/sinks.py; `build_trackers` starts every one that is on).

Build one `MetricsLogger` in the process that reports (rank 0 of a distributed run) and call `log` at each
logging step. A value of None means "not available" (MFU on a GPU missing from the peak table): it is
null in the JSONL file and skipped by TensorBoard and W&B. A `step` key among the metrics is the x-axis,
not a series. A resumed run (`resumed_from`) first drops what the interrupted attempt logged after the
checkpoint it resumes from, in the JSONL file and in TensorBoard, so each step appears once, and
continues the same W&B run.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from engine.config.job import JobConfig
from engine.config.registry import METRICS_SINKS
from engine.durable import space_checked, write_durably
from engine.errors import UserError
from engine.run_files import METRICS_FILE


class Sink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float | None]) -> None: ...

    def close(self) -> None: ...


class MetricsLogger:
    """Fans each `log` call out to every sink; usable as a context manager so sinks close on errors too."""

    def __init__(self, sinks: Mapping[str, Sink]) -> None:
        self.named = dict(sinks)  # registry name (METRICS_SINKS) → the started sink: each one's callback name

    @property
    def sinks(self) -> list[Sink]:
        return list(self.named.values())

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    @property
    def wandb_run_id(self) -> str | None:
        """The W&B run's id, saved in checkpoints so a resumed run logs into the same W&B run."""
        wandb = self.named.get("wandb")
        return wandb.run.id if wandb is not None else None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@dataclass(frozen=True)
class SinkContext:
    """What every sink may start from besides its own config: the job, the run directory, the W&B run name
    default (`run_name`), the step of the checkpoint a resumed run starts from, and the W&B run it logged into."""

    cfg: JobConfig
    run_dir: Path
    run_name: str | None = None
    resumed_from: int | None = None
    wandb_run_id: str | None = None


def build_trackers(
    cfg: JobConfig,
    run_dir: str | Path,
    run_name: str | None = None,
    resumed_from: int | None = None,
    wandb_run_id: str | None = None,
) -> MetricsLogger:
    """Every sink `cfg.metrics` turns on (engine/metrics/sinks.py: `METRICS_SINKS`), writing under `run_dir`, each
    started from its own config object and a `SinkContext`.

    `run_name` names the W&B run when `metrics.wandb_run_name` is unset (default: the run directory's name).
    `resumed_from` is the step of the checkpoint a resumed run starts from; `wandb_run_id` the W&B run
    it logged into (its checkpoint records it). `metrics.wandb_run_id`, when set, names the W&B run to log
    into instead, e.g. to continue a run started elsewhere.
    """
    context = SinkContext(cfg, Path(run_dir), run_name, resumed_from, wandb_run_id)
    sinks: dict[str, Sink] = {}
    try:
        for sink in METRICS_SINKS.enabled(cfg.metrics):
            sinks[sink.name] = sink.implementation()(METRICS_SINKS.own(sink, cfg.metrics), context)
    except BaseException:
        MetricsLogger(sinks).close()
        raise
    return MetricsLogger(sinks)


def start_jsonl(own: Any, context: SinkContext) -> JsonlSink:
    return JsonlSink(context.run_dir / METRICS_FILE, context.resumed_from)


def start_tensorboard(own: Any, context: SinkContext) -> TensorBoardSink:
    return TensorBoardSink(context.run_dir / (own.tensorboard_dir or "tensorboard"), context.resumed_from)


def start_wandb(own: Any, context: SinkContext) -> WandbSink:
    name = own.wandb_run_name or context.run_name or context.run_dir.name
    return WandbSink(context.cfg, context.run_dir, name, own.wandb_run_id or context.wandb_run_id)


class JsonlSink:
    """One JSON object per call, `{"step", "time", **metrics}`, flushed at once so a crash loses no line.

    Non-finite floats (a diverged loss) are written as null, keeping every line standard JSON.
    """

    def __init__(self, path: Path, resumed_from: int | None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if resumed_from is not None and path.exists():
            keep_records_through(path, resumed_from)
        self.path = path
        self.file = path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        record = {"step": step, "time": time.time(), **{k: finite_or_none(v) for k, v in metrics.items()}}
        with space_checked(self.path):
            self.file.write(json.dumps(record, allow_nan=False) + "\n")
            self.file.flush()

    def close(self) -> None:
        with space_checked(self.path):  # closing flushes again what a full disk refused
            self.file.close()


def series(metrics: Mapping[str, float | None]) -> dict[str, float]:
    """What TensorBoard and W&B plot: every available value except the step itself."""
    return {k: v for k, v in metrics.items() if v is not None and k != "step"}


def finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def keep_records_through(path: Path, step: int) -> None:
    """Drop records after `step` and a half-written last line (a kill mid-write). The file is rewritten to
    a temporary and renamed over the original, so an interruption here leaves the old file or the new one."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if line.endswith("\n") and record_step(path, line) <= step]
    write_durably(path, "".join(kept))


def record_step(path: Path, line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        raise UserError(
            f"{path} has a line that is not a metrics record: {line.strip()[:80]!r}",
            "move the file aside; the resumed run will start a new one",
        ) from None


class TensorBoardSink:
    """Scalars through torch's SummaryWriter; on resume, `purge_step` hides the interrupted attempt's later events."""

    def __init__(self, log_dir: Path, resumed_from: int | None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError(
                "metrics.enable_tensorboard = true but tensorboard is not installed",
                "pip install tensorboard (or 'forge-lm[tracking]'), or set metrics.enable_tensorboard = false",
            ) from None
        purge = resumed_from + 1 if resumed_from is not None else None
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        for key, value in series(metrics).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in `run_dir/wandb` with the resolved config; `WANDB_MODE=offline` logs locally (`wandb sync`).

    Metrics are plotted against an explicit `step` metric, the training step. Its run id is its state: the
    checkpoint keeps it under its registered name (engine/metrics/callback.py), so a resumed run logs into the
    same W&B run.
    """

    def __init__(self, cfg: JobConfig, run_dir: Path, name: str, run_id: str | None) -> None:
        try:
            import wandb
        except ImportError:
            raise UserError(
                "metrics.enable_wandb = true but wandb is not installed",
                "pip install wandb (or 'forge-lm[tracking]'), or set metrics.enable_wandb = false",
            ) from None
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=cfg.metrics.wandb_project,
                name=name,
                dir=run_dir,
                id=run_id,
                resume="allow" if run_id else None,
                config=cfg.model_dump(mode="json"),
                allow_val_change=True,
            )
        except wandb.errors.Error as e:
            raise UserError(
                f"W&B could not start a run: {e}",
                "run `wandb login`, or set WANDB_MODE=offline to log locally, or set metrics.enable_wandb = false",
            ) from None
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        self.run.log({**series(metrics), "step": step})

    def state_dict(self) -> dict[str, str]:
        return {"run_id": self.run.id}

    def close(self) -> None:
        self.run.finish()
