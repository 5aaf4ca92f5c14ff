"""Console output shared by every command: plain lines off a terminal, a panel for user errors."""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from typing import Any, Self

import typer
from rich.console import Console, RenderableType
from rich.markup import escape
from rich.measure import Measurement
from rich.panel import Panel
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

console = Console()
err_console = Console(stderr=True)

USER_ERROR_EXIT = 2
PLAIN_INTERVAL_S = 10.0  # progress lines off a terminal: at most one every this many seconds


def is_interactive() -> bool:
    """A live dashboard and spinners only make sense on a real terminal."""
    return console.is_terminal and not console.is_dumb_terminal


def show_user_error(err: Exception) -> None:
    """Render a user error (exit code 2): a table of field → problem → fix for config errors, else a panel."""
    from engine.errors import ConfigError

    if isinstance(err, ConfigError):
        table = Table(show_header=True, header_style="bold", expand=False)
        table.add_column("field")
        table.add_column("problem")
        table.add_column("how to fix")
        for issue in err.issues:
            table.add_row(escape(issue.path), escape(issue.problem), escape(issue.hint))
        title = f"{len(err.issues)} configuration error(s)" + (f" in {escape(err.source)}" if err.source else "")
        print_titled(Panel(table, title=title, border_style="red", expand=False), title)
        return
    hint = getattr(err, "hint", "")
    body = escape(str(getattr(err, "message", err))) + (f"\n[dim]fix:[/dim] {escape(hint)}" if hint else "")
    err_console.print(Panel(body, title="error", border_style="red", expand=False))


def print_titled(panel: Panel, title: str) -> None:
    """An error panel on stderr whose title shows whole: off a terminal the panel is made as wide as its title
    needs (the body still wraps at the console's width), on a terminal the terminal's width decides."""
    if err_console.is_terminal and not err_console.is_dumb_terminal:
        err_console.print(panel)
        return
    widened(err_console, Text.from_markup(title).cell_len + 6).print(panel)  # two corners, spaces and rules


def show_config_warnings(warnings: list[Any], to: Console | None = None) -> None:
    """Config warnings (`JobConfig.warnings`): the run goes ahead, the user is told what it does."""
    for issue in warnings:
        hint = f" [dim]({escape(issue.hint)})[/dim]" if issue.hint else ""
        (to or err_console).print(
            f"[yellow]warning:[/yellow] {escape(issue.path)}: {escape(issue.problem)}{hint}", soft_wrap=True
        )


def show_run_failure(message: str) -> None:
    """A run that stopped for a reason that is not a bug (diverged, a rank hung): a panel, no traceback."""
    err_console.print(Panel(escape(message), title="training stopped", border_style="red", expand=False))


def user_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn `engine.errors.UserError` raised by a command into a panel and exit code 2, and `DiskFull` into one
    line and exit code 1."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        from engine.errors import DiskFull, UserError
        from engine.parallel.place import process_place

        try:
            return command(*args, **kwargs)
        except DiskFull as err:
            err_console.print(f"error: {err}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except UserError as err:
            rank = process_place().rank
            if rank == 0:
                show_user_error(err)
            else:  # in a multi-process run rank 0 shows the panel; the others one line, in case only they failed
                err_console.print(f"rank {rank}: {err.message}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(USER_ERROR_EXIT) from None

    return run


class LiveBar:
    """A progress view drawn by a Rich `Progress` (`self.bar`), live while the `with` block runs."""

    bar: Progress

    def __enter__(self) -> Self:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()


class PlainLines:
    """A progress view that prints plain lines as it is updated (logs, pipes): nothing to start or stop, and a
    line at most every PLAIN_INTERVAL_S unless something worth saying at once happened."""

    target: Console
    last_line: float = 0.0  # when the last line was printed (time.perf_counter())

    def due(self) -> bool:
        """Whether PLAIN_INTERVAL_S have passed since the last line (the caller then prints one)."""
        return time.perf_counter() - self.last_line >= PLAIN_INTERVAL_S

    def say(self, text: str) -> None:
        self.last_line = time.perf_counter()
        self.target.print(text, markup=False, highlight=False, soft_wrap=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def print_wide(renderable: RenderableType, to: Console | None = None) -> None:
    """A table printed whole: off a terminal (a pipe, a log) at its natural width, a row a line, rather than
    at 80 columns, where Rich narrows columns below their longest word and ends it in `…` (it does not keep
    a column's minimum when it shrinks one, so only the natural width is sure to cut nothing)."""
    target = to or console
    if target.is_terminal and not target.is_dumb_terminal:  # the terminal's width: a resize re-wraps it
        target.print(renderable)
        return
    widened(target, Measurement.get(target, target.options.update_width(10_000), renderable).maximum).print(renderable)


def widened(target: Console, width: int) -> Console:
    """A console like `target` (its stream as of now, its colours) at least `width` columns wide, for one print
    (`print(width=)` can only narrow). A copy, not `target.width = …` and back: setting the width pins it, so
    `target` would stop following COLUMNS and the terminal for every later print in the process."""
    return Console(
        file=target.file,
        width=max(width, target.width),
        color_system=target.color_system,  # type: ignore[arg-type]  (the name it detected, or None)
        no_color=target.no_color,
    )


def print_json(data: Any) -> None:
    """Machine-readable output: plain JSON on stdout, no styling."""
    import json

    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
