"""The run directory's record of its evaluations: `evals.jsonl`, one JSON object per `forge eval` of one of
its checkpoints, read back by `forge runs` (engine/runs.py). Torch-free.

A record: {"time", "step", "checkpoint", "kind": "tasks" | "perplexity", "metrics": {KEY: value},
"stderr": {KEY: value}, …what was asked}. Task keys are TASK/METRIC (as in-loop metrics are named); perplexity
keys are SOURCE/perplexity, SOURCE/bits_per_byte, SOURCE/loss. Only a finished evaluation is recorded.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from engine.durable import write_durably
from engine.run_files import EVALS_FILE, RUN_CONFIG


def run_dir_of(checkpoint: Path) -> Path | None:
    """The run directory a step_N folder belongs to (the nearest folder above it with a config.toml), or None
    for a checkpoint that has none (a `forge convert from-hf` folder)."""
    return next((p for p in checkpoint.resolve().parents if (p / RUN_CONFIG).is_file()), None)


def append_record(run_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    """Add `record` (with the time) to the run's evals.jsonl. The file is rewritten whole and renamed into
    place: a kill leaves it with or without the record, never a torn line."""
    path = run_dir / EVALS_FILE
    before = path.read_bytes() if path.is_file() else b""
    record = {"time": time.time(), **record}
    write_durably(path, before + (json.dumps(record) + "\n").encode())
    return record
