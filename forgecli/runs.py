"""`forge runs [DIR]`: the runs under a folder with their status and progress; `forge runs compare RUN…`: their
configs, final metrics and curves side by side. What a run directory holds is read by `engine.runs`."""

from __future__ import annotations

import time
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import typer
from rich import box
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from engine.runs import LAYER_LOAD
from forgecli.termplot import line_plot
from forgecli.ui import console, is_interactive, print_json, print_wide, user_errors

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from engine.runs import RunSummary

STATUS_STYLES = {
    "running": "bold cyan",
    "complete": "green",
    "preempted": "yellow",
    "failed": "bold red",
    "unreadable": "bold red",
}
PLOTTED = {"loss": "training loss", "eval_loss": "eval loss", "lr": "learning rate", "tokens_per_sec": "tokens/s"}


class RunsGroup(TyperGroup):
    """`forge runs [DIR]` lists, `forge runs compare RUN…` compares: a first word that names no subcommand
    (a folder, an option, nothing) belongs to `list`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ctx.help_option_names):
            args = ["list", *args]
        return super().parse_args(ctx, args)


app = typer.Typer(cls=RunsGroup, help="List the runs under a folder, or compare some of them.", no_args_is_help=False)


class XAxis(StrEnum):
    steps = "steps"
    tokens = "tokens"


@app.command("list")
@user_errors
def list_runs(
    directory: Path = typer.Argument(Path("runs"), help="Folder holding run directories (searched recursively)."),
    as_json: bool = typer.Option(False, "--json", help="Print the runs as a JSON list."),
) -> None:
    """Every run under DIR: status (running, complete, preempted, failed), step of max, tokens, last training
    and eval loss, tokens/s, newest complete checkpoint, and how long ago it last wrote anything.
    `forge runs DIR` is the same as `forge runs list DIR`. A run whose config.toml cannot be read is listed
    as unreadable with the problem as its detail, and the others as usual (exit code 0).

    [bold]Examples[/bold]

      forge runs

      forge runs /scratch/$USER/runs --json

    """
    from dataclasses import asdict

    from engine.runs import find_runs, summarize_run

    runs = [summarize_run(path, name_under(directory, path)) for path in find_runs(directory)]
    if as_json:
        print_json([asdict(run) for run in runs])
    elif not runs:
        console.print(f"no runs under {directory}", markup=False, highlight=False)
    else:
        print_wide(runs_table(runs))


def name_under(root: Path, run_dir: Path) -> str:
    return str(run_dir.relative_to(root)) if run_dir != root else run_dir.name


def runs_table(runs: list[RunSummary]) -> Table:
    """One row per run; the last column (why a run is in its state) is cut to the width left, never wrapped.
    With an MoE run among them, an `expert load` column and a caption that says what it means."""
    moe = any(run.expert_imbalance is not None for run in runs)
    table = Table(
        box=box.SIMPLE_HEAD if is_interactive() else None,
        header_style="bold",
        pad_edge=False,
        caption=EXPERT_LOAD_MEANING if moe else None,
        caption_justify="left",
    )
    columns = ("run", "status", "step", "tokens", "loss", "eval loss", "tokens/s", "checkpoint", "age")
    for column in (*columns, "expert load") if moe else columns:
        table.add_column(column, justify="left" if column in ("run", "status") else "right", no_wrap=True)
    with_evals = any(run.evals for run in runs)
    if with_evals:
        table.add_column("evals", no_wrap=True, overflow="ellipsis", max_width=40)
    table.add_column("detail")  # the one column Rich narrows first; each cell cut, not wrapped (whole in --json)
    now = time.time()
    for run in runs:
        evals = (
            [Text(" ".join(f"{k}={v:.4g}" for k, v in run.evals.items()) or "-", no_wrap=True)] if with_evals else []
        )
        load = [expert_load(run)] if moe else []
        table.add_row(
            escape(run.name),
            f"[{STATUS_STYLES.get(run.status, '')}]{run.status}[/]",
            f"{fmt(run.step)}/{fmt(run.max_steps)}",
            human(run.tokens_seen),
            fmt(run.loss, ".4f"),
            fmt(run.eval_loss, ".4f"),
            fmt(run.tokens_per_sec, ",.0f"),
            fmt(run.last_checkpoint),
            age(now - run.updated) if run.updated else "-",
            *load,
            *evals,
            Text(run.detail, no_wrap=True, overflow="ellipsis"),
        )
    return table


EXPERT_LOAD_MEANING = (
    "expert load: the worst MoE layer's max/mean tokens per expert at the last logged step, and which layer "
    "(1 = balanced; num_experts / moe_top_k = every token on the same experts)"
)


def expert_load(run: RunSummary) -> str:
    if run.expert_imbalance is None:
        return "-"
    return f"{run.expert_imbalance:.2f} (layer {run.expert_imbalance_layer})"


def fmt(value: float | None, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def human(count: int | None) -> str:
    """1234567 → 1.2M: token counts span six orders of magnitude across a sweep."""
    if count is None:
        return "-"
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)


def age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{max(seconds, 0):.0f}s ago"


@app.command("compare")
@user_errors
def compare(
    run_dirs: list[Path] = typer.Argument(..., help="Run directories to compare."),
    plot: Path | None = typer.Option(
        None,
        "--plot",
        help="Write training and eval loss, lr and tokens/s to this "
        "PNG (needs matplotlib: pip install 'forge-lm\\[plot]').",
    ),
    x: XAxis = typer.Option(XAxis.steps, "--x", help="What the curves are plotted against."),
    as_json: bool = typer.Option(
        False, "--json", help="Print the differing config fields, final metrics and curves as JSON."
    ),
) -> None:
    """Several runs side by side: the config fields that differ, their final metrics, and their loss curves
    (in the terminal, or with --plot as a PNG of training and eval loss, learning rate and tokens/s); the
    results of `forge eval` on their checkpoints, newest step first in a table and against the step in a plot.

    [bold]Examples[/bold]

      forge runs compare runs/lr1e-3 runs/lr3e-3

      forge runs compare runs/* --plot compare.png --x tokens

    """
    from engine.errors import UserError
    from engine.run_files import RUN_CONFIG
    from engine.runs import config_differences, curves, eval_curves, summarize_run

    for path in run_dirs:
        if not (path / RUN_CONFIG).is_file():
            raise UserError(
                f"{path} is not a Forge run directory (it has no {RUN_CONFIG})",
                "pass folders `forge train` wrote, e.g. runs/debug",
            )
    names = unique_names(run_dirs)
    runs = [summarize_run(path, name) for path, name in zip(run_dirs, names)]
    differences = config_differences(run_dirs)
    series = {name: curves(path, x.value) for path, name in zip(run_dirs, names)}
    evals = {name: eval_curves(path) for path, name in zip(run_dirs, names)}
    if plot is not None:
        save_plot(series, plot, x.value)
    if as_json:
        from dataclasses import asdict

        print_json(
            {"differences": differences, "runs": [asdict(run) for run in runs], "curves": series, "evals": evals}
        )
        return
    print_wide(differences_table(names, differences))
    print_wide(runs_table(runs))
    if any(run.evals for run in runs):
        print_wide(evals_table(runs))
    terminal_width = min(console.width, 120)
    losses = [
        (f"{name} {label}", *run[key])
        for name, run in series.items()
        for key, label in (("loss", "train"), ("eval_loss", "eval"))
        if key in run
    ]
    console.print(line_plot(losses, width=max(terminal_width - 12, 20), height=16, title="loss", x_label=x.value))
    for key in sorted({key for run in evals.values() for key, (steps, _) in run.items() if len(steps) > 1}):
        lines = [(name, *run[key]) for name, run in evals.items() if key in run]
        console.print(line_plot(lines, width=max(terminal_width - 12, 20), height=10, title=key, x_label="steps"))
    if plot is not None:
        console.print(f"plot: {plot}", markup=False, highlight=False)


def unique_names(run_dirs: list[Path]) -> list[str]:
    """The folder names, or the whole paths where two runs share a name (runs/a/seed1 and runs/b/seed1)."""
    names = [path.name for path in run_dirs]
    return [name if names.count(name) == 1 else str(path) for name, path in zip(names, run_dirs)]


def evals_table(runs: list[RunSummary]) -> Table:
    """`forge eval` results (each run's newest evaluated step), one row per metric."""
    keys = sorted({key for run in runs for key in run.evals})
    table = Table(
        box=box.SIMPLE_HEAD if is_interactive() else None,
        header_style="bold",
        pad_edge=False,
        title="forge eval (newest evaluated checkpoint)",
        title_justify="left",
    )
    table.add_column("metric", no_wrap=True)
    for run in runs:
        table.add_column(escape(run.name), justify="right")
    for key in keys:
        table.add_row(escape(key), *(fmt(run.evals.get(key), ".4f") for run in runs))
    return table


def differences_table(names: list[str], differences: dict[str, list[Any]]) -> Table:
    table = Table(
        box=box.SIMPLE_HEAD if is_interactive() else None,
        header_style="bold",
        pad_edge=False,
        title="config fields that differ" if differences else "the configs are identical",
        title_justify="left",
    )
    table.add_column("field", no_wrap=True)
    for name in names:
        table.add_column(escape(name))
    for key, values in differences.items():
        table.add_row(key, *(escape("-" if v is None else str(v)) for v in values))
    return table


def save_plot(series: dict[str, dict[str, tuple[list[float], list[float]]]], path: Path, x: str) -> Figure:
    """Four panels (training loss, eval loss, learning rate, tokens/s), one line per run, and for MoE runs a
    fifth: each layer's max/mean tokens per expert, one line per run and layer; returns the figure."""
    from engine.errors import UserError

    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed, and none is opened
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(
            "--plot needs matplotlib, which is not installed",
            "pip install 'forge-lm[plot]' (or pip install matplotlib)",
        ) from None
    layer_loads = {name: [key for key in run if LAYER_LOAD.fullmatch(key)] for name, run in series.items()}
    moe = any(layer_loads.values())
    figure = Figure(figsize=(10, 9.75 if moe else 6.5), layout="constrained")
    panels = list(figure.subplots(3 if moe else 2, 2).flat)
    for axes, (key, label) in zip(panels, PLOTTED.items()):
        for name, curves_of_run in series.items():
            if key in curves_of_run:
                axes.plot(*curves_of_run[key], label=name, marker="o" if key == "eval_loss" else None, markersize=3)
        axes.set_title(label)
        axes.set_xlabel(x)
        axes.grid(alpha=0.3)
    figure.axes[0].legend(fontsize="small")
    if moe:
        plot_layer_loads(panels[4], series, layer_loads, x)
        panels[5].set_visible(False)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    return figure


def plot_layer_loads(axes: Any, series: dict[str, dict[str, Any]], layer_loads: dict[str, list[str]], x: str) -> None:
    """Each MoE layer's max/mean tokens per expert, one line per run and layer."""
    for name, keys in layer_loads.items():
        for key in keys:
            axes.plot(*series[name][key], label=f"{name} layer {key.split('/')[1]}", linewidth=1)
    axes.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    axes.set_title("expert load per layer: max/mean tokens per expert (1 = balanced)")
    axes.set_xlabel(x)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="x-small", ncol=2)
