"""Single-process runs of a small model through the CLI subprocess, for the resume and run-listing tests: the arguments, the environment and the per-step losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

TINY = [
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--train.seq_len=64",
    "--model.max_seq_len=64",
    "--train.batch_size=4",
    "--metrics.log_interval=1",
    "--eval.interval=5",
    "--eval.steps=2",
    "--checkpoint.interval=4",
    "--scheduler.warmup_steps=3",
]


def child_env() -> dict[str, str]:
    """Read at each call, after conftest's session fixture has set FORGE_CACHE_DIR and WANDB_MODE."""
    return {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}


def forge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "forgecli.app", *args],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    # Whole lines only: training may be writing the last one as the test reads.
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


def losses(run_dir: Path) -> dict[int, tuple[float, float]]:
    steps = [r["step"] for r in records(run_dir) if "loss" in r]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records(run_dir) if "loss" in r}
