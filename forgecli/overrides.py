"""Collect `--section.key=value` (or `--section.key value`) overrides from the arguments Typer left over."""

from __future__ import annotations

from engine.errors import UserError


def collect_overrides(args: list[str]) -> list[str]:
    overrides: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise UserError(f"unexpected argument {arg!r}", "overrides look like --section.key=value")
        if "=" not in arg and i + 1 < len(args) and not args[i + 1].startswith("--"):
            arg = f"{arg}={args[i + 1]}"
            i += 1
        overrides.append(arg)
        i += 1
    return overrides
