"""Shell completion beyond Typer's own: preset paths for PRESET arguments, and `--section.key=value`
overrides (names, and the values of fields that have few) from the config schema. Nothing here runs unless
the shell asks for completions; the schema is imported then, never torch."""

from __future__ import annotations

from pathlib import Path

import click
from click.shell_completion import CompletionItem
from typer.core import TyperCommand


def complete_preset(incomplete: str) -> list[str]:
    """TOML files and folders that start with what was typed (folders end in "/" to go on into them)."""
    folder, _, stem = incomplete.rpartition("/")
    base = Path(folder or ".")
    if folder and not base.is_dir():
        return []
    prefix = f"{folder}/" if folder else ""
    found = []
    for entry in sorted(base.iterdir(), key=lambda p: p.name):
        if not entry.name.startswith(stem) or (entry.name.startswith(".") and not stem.startswith(".")):
            continue
        if entry.is_dir():
            found.append(f"{prefix}{entry.name}/")
        elif entry.suffix == ".toml":
            found.append(f"{prefix}{entry.name}")
    return found


def complete_override(incomplete: str, args: list[str]) -> list[CompletionItem]:
    """`--section.key=` names that start with `incomplete`; or, after a field's name (`--train.mixed_precision
    b`, which overrides accept, or bash's `--train.mixed_precision=b`, which bash splits at the "="), the
    choices of that field when it has few."""
    from engine.config.reference import all_field_docs

    docs = {f"--{doc.section}.{doc.name}": doc for doc in all_field_docs()}
    named = args[-2] if args[-1:] == ["="] and len(args) > 1 else args[-1] if args else None
    if named in docs and not incomplete.startswith("-"):
        return [CompletionItem(value) for value in docs[named].choices if value.startswith(incomplete)]
    if not incomplete.startswith("--"):
        return []
    return [
        CompletionItem(f"{option}=", help=doc.description)
        for option, doc in docs.items()
        if option.startswith(incomplete)
    ]


class OverrideCommand(TyperCommand):
    """A command that takes `--section.key=value` overrides as extra arguments: its completion offers them
    after its own options."""

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[CompletionItem]:
        return super().shell_complete(ctx, incomplete) + complete_override(incomplete, ctx.args)
