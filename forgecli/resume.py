"""`forge resume`: continue a run from its newest complete checkpoint, with its saved config."""

from __future__ import annotations

from pathlib import Path

import typer

from forgecli.overrides import collect_overrides
from forgecli.train import AllowCode, NprocPerNode, SummaryAsJson, launch, run_training
from forgecli.ui import user_errors


@user_errors
def resume(
    ctx: typer.Context,
    run_dir: Path = typer.Argument(..., help="A run directory written by forge train."),
    as_json: SummaryAsJson = False,
    nproc_per_node: NprocPerNode = 1,
    allow_code: AllowCode = False,
) -> None:
    """Continue a run from its newest complete checkpoint, with the config saved in it.

    Overrides that keep the computation the same are allowed (train.max_steps, logging, eval,
    checkpoint cadence, profiling, data-loader workers); ones that would change the model, the data or
    the optimization are refused. The losses after the resume equal those of an uninterrupted run.
    The code the saved config names (train.hooks, eval.tasks task files) runs only with --allow-code.

    [bold]Examples[/bold]

      forge resume runs/debug

      forge resume runs/debug --train.max_steps=600

      forge resume runs/with_hooks --allow-code

    """
    from engine.train.run_dir import run_config

    cfg = run_config(run_dir, collect_overrides(ctx.args), allow_code)
    if nproc_per_node > 1:
        launch(cfg, nproc_per_node)
    run_training(cfg, run_dir, as_json, allow_code)
