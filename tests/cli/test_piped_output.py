"""Off a terminal (a pipe, a log, CI) output is plain lines that a reader gets whole: at the 80 columns a pipe
gets, no table cell and no panel title is cut with `…`."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.cli import forge

PIPE_WIDTH = "80"  # what Rich assumes off a terminal without COLUMNS


def cut_lines(text: str) -> list[str]:
    """Lines with a cell or title Rich cut; the learning-rate line's `0 … 0.002` is a range, written so."""
    return [line for line in text.splitlines() if "…" in line and not line.startswith("Learning rate")]


def test_validate_config_tables_print_whole_at_80_columns():
    result = forge(
        "validate-config", "presets/debug.toml", "--world-size", "8", "--distributed.tp=2", "--gpu-memory-gib", "80",
        COLUMNS=PIPE_WIDTH,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert cut_lines(result.stdout) == []
    header = next(line for line in result.stdout.splitlines() if "pp rank" in line)
    for column in ("blocks", "in flight", "params", "optimizer", "activations", "buffers", "fits 80 GiB"):
        assert column in header, header


def test_an_error_panels_title_prints_whole_at_80_columns(tmp_path: Path):
    preset = tmp_path / "a-folder-with-a-long-name" / "and-a-preset-named-at-length-as-sweeps-are.toml"
    preset.parent.mkdir()
    preset.write_text("[train]\nmax_steps = -1\n")
    result = forge("validate-config", str(preset), COLUMNS=PIPE_WIDTH)
    assert result.returncode == 2, result.stderr
    assert cut_lines(result.stderr) == [], result.stderr
    assert f"1 configuration error(s) in {preset}" in result.stderr.splitlines()[0]


def test_printing_whole_leaves_the_consoles_following_columns(monkeypatch, capsys):
    """Widening a console for one table or panel must not pin its width: a later command in the same process
    (CliRunner, a library user) with another COLUMNS gets that width (a pinned 80 wrapped a message that a test
    of another file then could not find)."""
    from rich.panel import Panel
    from rich.table import Table

    from forgecli import ui

    monkeypatch.setenv("COLUMNS", "80")
    table = Table("a column whose header is long", "another")
    table.add_row("x" * 120, "y")
    ui.print_wide(table)
    ui.print_titled(Panel("body", title="a title " * 20), "a title " * 20)
    assert "x" * 120 in capsys.readouterr().out  # printed whole, off a terminal
    monkeypatch.setenv("COLUMNS", "300")
    assert ui.console.width == 300 and ui.err_console.width == 300
