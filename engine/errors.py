"""Errors that mean "the user asked for something wrong", as opposed to a bug in Forge.

The CLI turns a `UserError` into a short panel and exit code 2, a `DiskFull` into one line and exit code 1 (the
machine's doing, as for a checkpoint that cannot be written); anything else is an internal failure (exit 1, with
a traceback). They subclass `ValueError` so library users can catch them the usual way.
"""

from __future__ import annotations

import errno
import os
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


class DiskFull(OSError):
    """A write failed for want of space (a full disk, or a quota): neither a bug nor the user's input. An
    OSError of errno ENOSPC still, raised from the original by `engine.durable.space_checked`, so code that
    handles a failed write (`except OSError`, `checkpoint.manager.out_of_space`) handles this one alike."""

    def __init__(self, path: object) -> None:
        super().__init__(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        self.message = (
            f"no space left on the disk writing {path}: free space (or write elsewhere) and run the command "
            "again (training resumes from its last checkpoint, tokenizing from its last shard)"
        )

    def __str__(self) -> str:
        return self.message
