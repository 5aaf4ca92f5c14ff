"""Where checkpoints lie in a run directory: one `step_N` folder per save, complete once its COMPLETE marker
is written. Torch-free, so that listing runs (`forge runs`) does not load torch.
"""

from __future__ import annotations

import re
from pathlib import Path

from engine.errors import UserError
from engine.safe_paths import resolves_inside

STEP_DIR = re.compile(r"^step_(\d+)$")
COMPLETE = "COMPLETE"


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step_N folder under root, complete or not, oldest first."""
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    return [(step, path) for step, path in step_dirs(root) if (path / COMPLETE).is_file()]


def checkpoint_root(run_dir: Path, checkpoint_dir: str) -> Path:
    """The folder a run's checkpoints are in: `checkpoint.dir` under the run directory, or where an absolute
    `checkpoint.dir` says (the user's explicit choice, locked with the run while it trains). A relative one
    that leads out of the run directory (`..`, a symlink) is refused before anything is read or written there:
    it would load, replace and prune another run's checkpoints."""
    given = Path(checkpoint_dir)
    if given.is_absolute():
        return given
    root = run_dir / given
    if ".." in given.parts or not resolves_inside(root, run_dir):
        raise UserError(
            f"checkpoint.dir = {checkpoint_dir!r} leads out of the run directory {run_dir}",
            'name a folder inside the run directory (the default is "checkpoints"), or give an absolute path to '
            "a folder of this run's own",
        )
    return root
