"""The names of the files a run directory holds that more than one room reads (training writes them; `forge
runs`, checkpoint lookup, `forge slurm status` and the metric sinks read or append them), and how a folder is
recognised as a run directory by them. Torch-free."""

from __future__ import annotations

from pathlib import Path

RUN_CONFIG = "config.toml"  # the resolved config: a resume and every reader of the run start from it
METRICS_FILE = "metrics.jsonl"  # one JSON object per logged step and per evaluation
EVALS_FILE = "evals.jsonl"  # one JSON object per `forge eval` of one of the run's checkpoints (engine/eval/record.py)


def enclosing_run_dir(path: Path) -> Path | None:
    """The run directory `path` is in or is: the nearest folder at or above it that `forge train` wrote (a
    config.toml and a metrics.jsonl), or None."""
    resolved = path.resolve()
    for folder in (resolved, *resolved.parents):
        if (folder / RUN_CONFIG).is_file() and (folder / METRICS_FILE).is_file():
            return folder
    return None
