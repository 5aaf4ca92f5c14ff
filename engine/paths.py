"""Whether a path that a file names (a saved config, a manifest) stays inside the folder it belongs to.

A run directory or data set handed over by someone else can name paths that lead out of it (`..`, an absolute
path, a symlink to another run's folder); what reads such a path checks it here first, before anything is
read, written or deleted there. Torch-free.
"""

from __future__ import annotations

from pathlib import Path


def resolves_inside(path: Path, folder: Path) -> bool:
    """`path` is `folder` or lies below it once every symlink on the way is followed."""
    return path.resolve().is_relative_to(folder.resolve())
