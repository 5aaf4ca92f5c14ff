"""Names read from files, and cache entries, kept inside their folder.

A manifest's shard list, a checkpoint's `checksums.json` and a cache entry are files anyone can edit or plant
(a data set served by someone else, a checkpoint copied from elsewhere, a shared cache). The names in them are
only ever file names beside the file that lists them, so any other spelling (an absolute path, `..`, a
sub-folder) is refused before anything is read, written or deleted; a symbolic link leading out of the folder,
or a device or pipe where a file belongs, is refused too: reading `/dev/zero` never ends, and writing or
deleting through a link changes files outside the folder. Every check is here, so that each reader refuses
the same names with the same message.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from engine.errors import UserError


class UnsafePath(UserError):
    """A name read from a file, or a cache entry, that would lead out of its folder."""


def plain_name(name: object, listed_in: object) -> str:
    """`name` as listed in `listed_in` (a file, or a URL), if it is a plain file name: no folder part, not `.`
    or `..`, not empty. Anything else is refused before it is joined to a folder."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise UnsafePath(
            f"{listed_in} names {name!r}, which is not a plain file name inside its folder",
            f"replace {listed_in} with one written by Forge: it only ever names files beside itself",
        )
    return name


def file_in(folder: Path, name: object, listed_in: object) -> Path:
    """`folder / name` for a `name` listed in `listed_in`: a plain name (`plain_name`), and, if something is
    there, a regular file or a link to one inside `folder` (never a device, a pipe, a folder, or a link
    leading out). A missing file is the caller's to report."""
    path = folder / plain_name(name, listed_in)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return path
    if stat.S_ISLNK(mode):
        target = Path(os.path.realpath(path))
        if not target.is_relative_to(Path(os.path.realpath(folder))):
            raise UnsafePath(
                f"{path}, listed in {listed_in}, is a symbolic link leading out of {folder} (to {target})",
                f"remove the link {path} (its target is left alone), or put the file itself there",
            )
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:  # a dangling link: missing, like any absent file
            return path
    if not stat.S_ISREG(mode):
        raise UnsafePath(
            f"{path}, listed in {listed_in}, is not a regular file (a device, pipe or folder)",
            f"replace {path} with the file that was written there",
        )
    return path


def cache_path(root: Path, *parts: str) -> Path:
    """`root / parts…` (a cache entry, or its lock), refused if any of them below `root` is a symbolic link:
    the cache writes and deletes inside its entries, which through a link would change the link's target.
    `root` itself (FORGE_CACHE_DIR, which may well be a link to a bigger disk) is the user's choice."""
    path = root
    for part in parts:
        path = path / plain_name(part, f"the Forge cache {root}")
        if path.is_symlink():
            raise UnsafePath(
                f"the Forge cache entry {path} is a symbolic link (to {os.readlink(path)}); Forge never writes "
                "or deletes through a link in its cache",
                f"remove the link (rm {path}; its target is left alone) and Forge rebuilds the entry",
            )
    return path


def resolves_inside(path: Path, folder: Path) -> bool:
    """`path` is `folder` or lies below it once every symlink on the way is followed (a path a saved config
    names, such as `checkpoint.dir`, checked before anything is written there)."""
    return path.resolve().is_relative_to(folder.resolve())
