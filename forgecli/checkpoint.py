"""`forge checkpoint verify RUN_DIR`: check every checkpoint of a run against the checksums written with it,
without training."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from forgecli.ui import LiveBar, PlainLines, err_console, print_json, print_wide, user_errors

app = typer.Typer(help="Inspect a run's checkpoints.", no_args_is_help=True)

DAMAGED_EXIT = 1
STYLES = {"ok": "green", "unverified": "yellow", "incomplete": "dim", "damaged": "bold red"}


@app.command("verify")
@user_errors
def verify(
    target: Path = typer.Argument(..., help="A run directory, its checkpoint folder, or one step_N folder."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per checkpoint."),
) -> None:
    """Read every file of every checkpoint and compare it with the checksum recorded when it was written.
    Exit 0 when every complete checkpoint is intact (or has no checksums: written before they existed),
    1 when one is damaged (the file is named), 2 when TARGET holds no checkpoint.

    [bold]Examples[/bold]

      forge checkpoint verify runs/debug

      forge checkpoint verify runs/debug/checkpoints/step_400 --json

    """
    from engine.checkpoint.locate import step_folders
    from engine.checkpoint.verify import verify_folders

    folders = step_folders(target)
    with progress_view(err_console) as view:
        verdicts = verify_folders(folders, view.update)
    if as_json:
        print_json([{"path": str(v.path), "status": v.status, "detail": v.detail} for v in verdicts])
    else:
        print_wide(verdict_table(verdicts))
    if any(v.status == "damaged" for v in verdicts):
        raise typer.Exit(DAMAGED_EXIT)


def verdict_table(verdicts: list[Any]) -> Table:
    table = Table(title="checkpoints", show_header=True, header_style="bold")
    table.add_column("checkpoint")
    table.add_column("status")
    table.add_column("detail")
    for v in verdicts:
        style = STYLES[v.status]
        table.add_row(escape(v.path.name), f"[{style}]{v.status}[/{style}]", escape(v.detail))
    return table


def progress_view(target: Console) -> RichProgressView | PlainProgressView:
    if target.is_terminal and not target.is_dumb_terminal:
        return RichProgressView(target)
    return PlainProgressView(target)


class RichProgressView(LiveBar):
    """A live bar over the bytes read so far."""

    def __init__(self, target: Console) -> None:
        self.bar = Progress(
            TextColumn("verifying"),
            BarColumn(),
            DownloadColumn(),
            TimeRemainingColumn(),
            console=target,
            transient=True,
        )
        self.task = self.bar.add_task("verifying", total=None)

    def update(self, done: int, total: int) -> None:
        self.bar.update(self.task, completed=done, total=total)


class PlainProgressView(PlainLines):
    """For logs: one line every 10 s, none for a check quicker than that."""

    def __init__(self, target: Console) -> None:
        self.target, self.last_line = target, time.perf_counter()

    def update(self, done: int, total: int) -> None:
        if self.due():
            self.say(f"verifying: {100 * done / max(total, 1):.0f}% of {total / 2**30:.2f} GiB")
