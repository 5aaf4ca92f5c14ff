"""Writing files so that a kill at any moment leaves the old file or the new one, never a torn one.

Used for everything a later run reads back: shards and manifests, checkpoint markers, the run's config,
the rewritten metrics log.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from engine.errors import DiskFull, UserError

TMP_SUFFIX = ".tmp"


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def space_checked(path: Path) -> Iterator[None]:
    """A full disk (or quota) while writing `path` becomes one `DiskFull` naming it; other errors pass as
    they are. Every write of a run's or a data set's files goes through here (`atomic_write`, the metrics log)."""
    try:
        yield
    except OSError as err:
        if err.errno not in NO_SPACE:
            raise
        raise DiskFull(path) from err


def check_writable(path: Path, named: str, folder: bool = False) -> None:
    """`path` can be written as asked, checked before anything is written: every folder above it that exists
    is a folder (a regular file there would fail halfway, as NotADirectoryError), and `path` is missing or
    what will be written there: a folder (`folder`), else a regular file, never a device, a FIFO or a link,
    which the rename of `atomic_write` would replace rather than write into. `named`: the input, for the
    message (`--out`, `PRESET`)."""
    for above in path.parents:
        if above.is_dir():
            break
        if above.exists() or above.is_symlink():
            raise UserError(
                f"{named} {path} is inside {above}, which is a file, not a folder",
                "pass a path whose existing folders are folders (missing ones are created)",
            )
    if folder and (path.exists() or path.is_symlink()) and not path.is_dir():
        raise UserError(f"{named} {path} is a file", "pass a directory path (it is created if missing)")
    if not folder and path.is_dir():
        raise UserError(f"{named} {path} is a directory", "name the file to write")
    if not folder and (path.is_symlink() or (path.exists() and not path.is_file())):
        kind = "a link" if path.is_symlink() else "not a regular file (a device, a FIFO or a socket)"
        raise UserError(f"{named} {path} is {kind}; Forge only replaces regular files", "name another file")


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write through `write` into a temporary sibling, fsync it, rename it over `path`, fsync the folder."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")
    try:
        with space_checked(path), open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_durably(path: Path, content: str | bytes) -> None:
    data = content.encode() if isinstance(content, str) else content
    atomic_write(path, lambda f: f.write(data))


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
