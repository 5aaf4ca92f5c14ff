"""`forge doctor`: is this machine ready to train? The checks live in `engine.preflight`; this only renders them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.text import Text

from forgecli.ui import console, print_json

if TYPE_CHECKING:  # the engine is imported when the command runs, not when `forge --help` loads the app
    from engine.preflight import CheckResult

MARKS = {"ok": ("✓", "green"), "warn": ("!", "yellow"), "fail": ("✗", "bold red"), "info": ("i", "cyan")}
NAME_WIDTH = 20


def doctor(
    directory: Path = typer.Option(
        Path("."),
        "--dir",
        exists=True,
        file_okay=False,
        resolve_path=True,
        help="Where run directories and checkpoints will go: its free space and write permission are checked.",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print the checks as a JSON list of {name, status, detail, fix}."
    ),
) -> None:
    """Check this machine before training: Python, torch, GPUs, NCCL, disk, permissions, gloo, extras, SLURM.

    Exits 1 when a required check fails: Python, torch, disk space, write permission, gloo process group.

    Missing extras are only warnings, and a machine without GPUs is fine.

    [bold]Examples[/bold]

      forge doctor

      forge doctor --dir /scratch/$USER/runs --json
    """
    from engine.preflight import any_failed, run_checks

    if as_json:
        results = list(run_checks(directory))
        print_json([r.to_dict() for r in results])
    else:
        results = []
        for result in run_checks(directory):  # streamed: the slow checks (imports, gloo) show progress
            console.print(check_line(result), soft_wrap=True)
            results.append(result)
        console.print(summary(results))
    if any_failed(results):
        raise typer.Exit(1)


def check_line(result: CheckResult) -> Text:
    """`mark name detail`, plus an aligned `fix:` line; printed unwrapped so log files keep one line per check."""
    mark, style = MARKS[result.status]
    line = Text.assemble(
        (mark, style),
        " ",
        (result.name.ljust(NAME_WIDTH), "bold" if result.status == "fail" else ""),
        " ",
        result.detail,
    )
    if result.fix:
        line.append("\n" + " " * (NAME_WIDTH + 3)).append("fix: ", style="bold").append(result.fix)
    return line


def summary(results: list[CheckResult]) -> Text:
    failed = sum(r.status == "fail" for r in results)
    warned = sum(r.status == "warn" for r in results)
    if failed:
        return Text(f"✗ {failed} required check(s) failed, {warned} warning(s)", style="bold red")
    if warned:
        return Text(f"! ready to train, {warned} warning(s)", style="yellow")
    return Text("✓ ready to train", style="bold green")
