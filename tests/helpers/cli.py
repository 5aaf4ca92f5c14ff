"""`forge` as a user types it: a subprocess in the repository, plain output, bounded in time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

FORGE = [sys.executable, "-m", "forgecli.app"]


def forge(*args: str, cwd: Path = REPO, timeout: int = 240, **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", **env_vars}
    return subprocess.run([*FORGE, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
