"""Where checkpoints lie in a run directory: one `step_N` folder per save, complete once its COMPLETE marker
is written. Torch-free, so that listing runs (`forge runs`) does not load torch.
"""

from __future__ import annotations

import re
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d+)$")
COMPLETE = "COMPLETE"


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step_N folder under root, complete or not, oldest first."""
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    return [(step, path) for step, path in step_dirs(root) if (path / COMPLETE).is_file()]
