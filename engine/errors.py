"""Errors that mean "the user asked for something wrong", as opposed to a bug in Forge.

The CLI turns a `UserError` into a short panel and exit code 2; anything else is an internal failure
(exit 1, with a traceback). They subclass `ValueError` so library users can catch them the usual way.
"""

from __future__ import annotations

from dataclasses import dataclass


class UserError(ValueError):
    """A mistake the user can fix: bad config, missing or malformed file, unsupported combination."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


@dataclass(frozen=True)
class ConfigIssue:
    """One problem with the configuration, located by its dotted field path."""

    path: str
    problem: str
    hint: str = ""


class ConfigError(UserError):
    """Every problem found in a configuration, reported together."""

    def __init__(self, issues: list[ConfigIssue], source: str = "") -> None:
        self.issues = issues
        self.source = source
        lines = [f"{i.path}: {i.problem}" + (f" ({i.hint})" if i.hint else "") for i in issues]
        where = f" in {source}" if source else ""
        super().__init__(f"{len(issues)} configuration error(s){where}:\n" + "\n".join(lines))


class DataError(UserError):
    """A data set, shard, manifest or tokenizer that cannot be used as asked."""
