"""`forge train`: train a preset into a run directory."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from forgecli.dashboard import LiveDashboard, PlainReporter
from forgecli.overrides import collect_overrides
from forgecli.ui import console, is_interactive, print_json, user_errors


@user_errors
def train(
    ctx: typer.Context,
    preset: Path = typer.Argument(..., help="TOML preset (or a run's config.toml)."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Where the run is written. Default: runs/<preset name>."),
    as_json: bool = typer.Option(False, "--json", help="Print the final summary as JSON on stdout (progress lines go to stderr)."),
) -> None:
    """Train a model into a run directory (config, metrics, logs, checkpoints).

    Overrides as --section.key=value, values as TOML literals (--optimizer.betas=[0.9,0.95]).

    [bold]Examples[/bold]

      forge train presets/debug.toml

      forge train presets/debug.toml --train.max_steps=50 --optimizer.lr=1e-3 --run-dir runs/lr1e-3

    """
    from engine.config import load_job_config
    from engine.train.trainer import train as run_training

    cfg = load_job_config(preset, collect_overrides(ctx.args))
    run_dir = run_dir or Path("runs") / preset.stem
    if as_json:  # stdout carries only the JSON summary; progress lines go to stderr
        reporter = PlainReporter(sys.stderr)
    else:
        reporter = LiveDashboard() if is_interactive() else PlainReporter()
    try:
        summary = run_training(cfg, run_dir, reporter)
    finally:
        if isinstance(reporter, LiveDashboard):
            reporter.stop()
    if as_json:
        print_json(summary)
    else:
        console.print(f"run directory: {run_dir}", markup=False, highlight=False)
