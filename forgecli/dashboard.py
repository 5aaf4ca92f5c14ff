"""Training progress on the console: a live Rich dashboard on a terminal, plain log lines otherwise. Both
are training-loop callbacks (engine/train/callbacks/base.py), on rank 0: they show every logged record, the
step's, the evaluation's, the tasks' and whatever another callback logs."""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from rich.columns import Columns
from rich.console import Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from engine.train.callbacks.base import PRIORITY, Callback
from forgecli.ui import console, show_config_warnings

if TYPE_CHECKING:
    from engine.train.trainer import TrainLoop


EXPERT_LOAD = "expert imbalance: the worst MoE layer's max/mean tokens per expert, 1 = balanced"


def fmt_metrics(metrics: dict[str, Any]) -> dict[str, str]:
    mfu = metrics.get("mfu")
    memory = metrics.get("mem_peak_gib")
    shown = {
        "loss": f"{metrics['loss']:.4f}",
        "lr": f"{metrics['lr']:.3e}",
        "grad norm": f"{metrics['grad_norm']:.3f}",
        "tokens/s": f"{metrics['tokens_per_sec']:,.0f}",
        "MFU": f"{100 * mfu:.1f}%" if mfu is not None else "n/a",
        "memory": f"{memory:.2f} GiB" if memory is not None else "n/a",
    }
    if "batch_sequences" in metrics:  # under a batch ramp: this step's global batch
        shown["batch"] = f"{metrics['batch_sequences']:,} seqs"
    for key, value in metrics.items():  # a mixture: each source's loss in the step (engine/train/source_losses.py)
        if key.startswith("loss/"):
            shown[f"loss {key.removeprefix('loss/')}"] = f"{value:.4f}"
    if "moe/imbalance" in metrics:
        shown["expert imbalance"] = expert_load(metrics)
    return shown


def expert_load(metrics: dict[str, Any]) -> str:
    """The worst MoE layer's max/mean tokens per expert and which layer it is (EXPERT_LOAD says it once), and
    how many experts got no token since the last logged step (docs/moe.md#metrics)."""
    text = f"{metrics['moe/imbalance']:.2f} (layer {metrics['moe/imbalance_layer']})"
    dead = metrics.get("moe/dead_experts")
    return text if not dead else f"{text}, {dead:.0f} dead"


def eta_seconds(started: float, start_step: int, step: int, max_steps: int) -> float:
    """The time per step since `started` (this attempt's first step `start_step` + 1) times the steps left."""
    return (time.perf_counter() - started) / max(step - start_step, 1) * (max_steps - step)


def eta_text(seconds: float | None) -> str:
    return "-:--:--" if seconds is None else str(timedelta(seconds=round(seconds)))


def fmt_value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def start_line(info: dict[str, Any]) -> str:
    resumed = f", resuming after step {info['start_step']}" if info["start_step"] else ""
    params = info["parameters"]
    active = (
        f" ({params['active']:,} active per token)" if params.get("active", params["total"]) != params["total"] else ""
    )
    peak = info.get("peak_flops")
    mfu_basis = f", MFU against {peak / 1e9:,.1f} GFLOP/s peak per device" if peak else ", no MFU (peak unknown)"
    return (
        f"training {params['total']:,} parameters{active} on {info['device']} ({info['dtype']}), "
        f"{info['max_steps']} steps × {info['tokens_per_step']:,} tokens{resumed}{mfu_basis} → {info['run_dir']}"
    )


class Console(Callback):
    """What both consoles share: where they run, and which record goes to which view."""

    priority = PRIORITY["console"]
    ranks = "main"
    failure_saves = False  # a console that cannot write stops the run with its own error, as before

    def on_start(self, loop: TrainLoop) -> None:
        self.show_start(loop.info)

    def on_metrics(self, step: int, metrics: dict[str, Any], kind: str, loop: TrainLoop) -> None:
        view = {"train": self.on_log, "eval": self.on_eval}.get(kind)
        if view is not None:
            view(step, metrics)
        else:
            self.on_other(step, metrics, kind)

    def on_checkpoint_written(self, step: int, path: Path, loop: TrainLoop) -> None:
        self.on_checkpoint(step, path)

    def on_end(self, summary: dict[str, Any], loop: TrainLoop) -> None:
        self.show_end(summary)


class PlainReporter(Console):
    """One line per event, no colour or cursor movement: for SLURM logs, CI and pipes."""

    def __init__(self, stream: TextIO = sys.stdout) -> None:
        self.stream = stream
        self.max_steps = self.start_step = 0
        self.started = time.perf_counter()
        self.explained = False  # EXPERT_LOAD printed

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def show_start(self, info: dict[str, Any]) -> None:
        self.max_steps, self.start_step = info["max_steps"], info["start_step"]
        self.started = time.perf_counter()
        show_config_warnings(info.get("warnings", []))
        self._line(start_line(info))

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        eta = eta_seconds(self.started, self.start_step, step, self.max_steps)
        shown = fmt_metrics(metrics)
        if "expert imbalance" in shown and not self.explained:
            self._line(EXPERT_LOAD)
            self.explained = True
        fields = " ".join(f"{k.replace(' ', '_')}={v}" for k, v in shown.items())
        self._line(f"step {step}/{self.max_steps} {fields} eta={eta:.0f}s")

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        ema = f" ema_loss={metrics['eval_loss_ema']:.4f}" if "eval_loss_ema" in metrics else ""
        self._line(f"eval step {step} loss={metrics['eval_loss']:.4f} perplexity={metrics['eval_perplexity']:.2f}{ema}")

    def on_other(self, step: int, metrics: dict[str, Any], kind: str) -> None:
        self._line(f"{kind} step {step} " + " ".join(f"{k}={fmt_value(v)}" for k, v in metrics.items()))

    def on_checkpoint(self, step: int, path: Path) -> None:
        self._line(f"checkpoint step {step} → {path}")

    def show_end(self, summary: dict[str, Any]) -> None:
        self._line(
            f"done: {summary['steps']} steps, {summary['tokens_seen']:,} tokens in {summary['train_time_sec']:.1f}s "
            f"of training (every attempt of the run), final loss {summary['final_loss']:.4f}"
        )


class LiveDashboard(Console):
    """A progress line (step, bar, elapsed time, ETA) over the latest metrics (other callbacks' too) as
    `name value` cells that wrap to the terminal's width, redrawn in place; it fits 80 columns. The elapsed time
    ticks between logged steps, so a slow step never looks like a hang. The ETA is measured from the first
    logged step on: the steps since the start over the time they took (compilation and start-up included)."""

    def __init__(self) -> None:
        self.progress = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(bar_width=20),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TextColumn("eta {task.fields[eta]}"),
            console=console,
        )
        self.task = self.progress.add_task("train", total=1, eta=eta_text(None))
        self.started, self.start_step, self.max_steps = time.perf_counter(), 0, 1
        self.metrics: dict[str, str] = {}
        self.eval: dict[str, str] = {}
        self.other: dict[str, str] = {}  # the latest values other callbacks logged
        self.live = Live(self._render(), console=console, refresh_per_second=4, transient=False)

    def _render(self) -> Group:
        shown = {**self.metrics, **self.eval, **self.other}
        cells = [Text.assemble((name, "bold cyan"), " ", value) for name, value in shown.items()]
        parts: list[Any] = [self.progress]
        if cells:
            parts.append(Columns(cells, padding=(0, 2)))
        if "expert imbalance" in self.metrics:
            parts.append(Text(EXPERT_LOAD, style="dim"))
        return Group(*parts)

    def show_start(self, info: dict[str, Any]) -> None:
        show_config_warnings(info.get("warnings", []))
        console.print(start_line(info), markup=False, highlight=False)
        self.started, self.start_step, self.max_steps = time.perf_counter(), info["start_step"], info["max_steps"]
        self.progress.update(self.task, total=self.max_steps, completed=self.start_step)
        self.live.start()

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics = fmt_metrics(metrics)
        eta = eta_seconds(self.started, self.start_step, step, self.max_steps)
        self.progress.update(self.task, completed=step, eta=eta_text(eta))
        self.live.update(self._render())

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.eval = {"eval loss": f"{metrics['eval_loss']:.4f}", "eval ppl": f"{metrics['eval_perplexity']:.2f}"}
        if "eval_loss_ema" in metrics:
            self.eval["eval loss (EMA)"] = f"{metrics['eval_loss_ema']:.4f}"
        self.live.update(self._render())

    def on_other(self, step: int, metrics: dict[str, Any], kind: str) -> None:
        self.other.update({k: fmt_value(v) for k, v in metrics.items()})
        self.live.update(self._render())

    def on_checkpoint(self, step: int, path: Path) -> None:
        self.live.console.print(f"[dim]checkpoint step {step} → {escape(str(path))}[/dim]")

    def show_end(self, summary: dict[str, Any]) -> None:
        self.live.update(self._render())
        self.live.stop()
        console.print(
            f"[green]✓ done[/green]: {summary['steps']} steps, {summary['tokens_seen']:,} tokens in "
            f"{summary['train_time_sec']:.1f}s of training (every attempt of the run), final loss {summary['final_loss']:.4f}"
        )

    def stop(self) -> None:
        if self.live.is_started:
            self.live.stop()
