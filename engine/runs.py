"""The runs under a folder, as `forge runs` lists and compares them: status, progress, final metrics, curves
and configs, read from what training leaves in each run directory. Read-only and torch-free.

A run's status:
  running     a process holds the run directory's lock (`engine.run_lock.lock_holder`);
  complete, preempted, failed
              how its last attempt ended, as training recorded it in `attempts.jsonl` (`record_attempt`);
  failed      with "killed (no end recorded)": the last attempt recorded its start and no end (SIGKILL, the
              OOM killer, a lost node, the shutdown watchdog's exit), and nothing holds the lock any more.
  unreadable  its config.toml is not UTF-8 TOML: listed with the problem as its detail, so that one damaged
              run does not hide the others.
A run directory from before `attempts.jsonl` is complete when its metrics reach `train.max_steps`, else failed.
"""

from __future__ import annotations

import json
import os
import re
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from engine.checkpoint.layout import complete_checkpoints
from engine.durable import write_durably
from engine.errors import UserError
from engine.run_files import EVALS_FILE, METRICS_FILE, RUN_CONFIG
from engine.run_lock import lock_holder

ATTEMPTS_FILE = "attempts.jsonl"
ACTIVITY_FILES = (METRICS_FILE, "train.log", ATTEMPTS_FILE)  # what a run writes as it goes: its age
CURVES = ("loss", "eval_loss", "lr", "tokens_per_sec")  # what `forge runs compare` plots
LAYER_LOAD = re.compile(r"moe/(\d+)/imbalance")  # an MoE layer's max/mean tokens per expert: plotted per layer


def record_attempt(run_dir: Path, event: str, **fields: Any) -> None:
    """Add `{"event", "time", **fields}` to the run's attempt log. The file is rewritten whole and renamed
    into place, so a kill at any moment leaves the log with or without this record, never a torn line."""
    path = run_dir / ATTEMPTS_FILE
    before = path.read_bytes() if path.is_file() else b""
    record = json.dumps({"event": event, "time": time.time(), **fields}) + "\n"
    write_durably(path, before + record.encode())


@dataclass
class RunSummary:
    """One row of `forge runs`: None where the run has not got that far (no step logged, no eval, …)."""

    name: str
    path: str
    status: str  # running | complete | preempted | failed | unreadable
    detail: str  # why: "pid 123", "SIGTERM at step 40", "killed: …", the error of a failed run
    step: int | None
    max_steps: int | None
    tokens_seen: int | None
    loss: float | None
    eval_loss: float | None
    tokens_per_sec: float | None
    last_checkpoint: int | None  # the step of the newest complete checkpoint
    updated: float | None  # when the run last wrote its metrics, log or attempt record (seconds since the epoch)
    expert_imbalance: float | None = None  # MoE: the worst layer's max/mean tokens per expert at the last log
    expert_imbalance_layer: int | None = None  # … and which layer that is
    evals: dict[str, float] = field(default_factory=dict)  # `forge eval` results of its newest evaluated step


def find_runs(root: Path) -> list[Path]:
    """Every run directory (a folder with a config.toml) at or under `root`, by path. The search does not go
    into a run directory: its checkpoints and tracker folders can hold many thousands of files."""
    if not root.is_dir():
        raise UserError(f"{root} is not a folder", "pass the folder your runs are in (default: runs/)")
    found = []
    for folder, subfolders, files in os.walk(root):
        if RUN_CONFIG in files:
            found.append(Path(folder))
            subfolders.clear()
    return sorted(found)


def summarize_run(run_dir: Path, name: str | None = None) -> RunSummary:
    records = metric_records(run_dir)
    train = next((r for r in reversed(records) if "loss" in r), {})
    evals = next((r for r in reversed(records) if "eval_loss" in r), {})
    try:
        config, unreadable = run_config(run_dir), None
    except UserError as problem:
        config, unreadable = {}, problem.message
    max_steps = config.get("train", {}).get("max_steps") or derived_max_steps(run_dir)
    if unreadable is None:
        status, detail = run_status(run_dir, train.get("step"), max_steps)
    else:
        status, detail = "unreadable", unreadable
    checkpoints = complete_checkpoints(run_dir / config.get("checkpoint", {}).get("dir", "checkpoints"))
    written = [(run_dir / f).stat().st_mtime for f in ACTIVITY_FILES if (run_dir / f).is_file()]
    return RunSummary(
        name or run_dir.name,
        str(run_dir),
        status,
        detail,
        train.get("step"),
        max_steps,
        train.get("tokens_seen"),
        train.get("loss"),
        evals.get("eval_loss"),
        train.get("tokens_per_sec"),
        checkpoints[-1][0] if checkpoints else None,
        max(written, default=None),
        train.get("moe/imbalance"),
        train.get("moe/imbalance_layer"),
        newest_evals(run_dir),
    )


def eval_records(run_dir: Path) -> list[dict[str, Any]]:
    """What `forge eval` recorded of the run's checkpoints (engine/eval/record.py), oldest first."""
    return [r for r in json_lines(run_dir / EVALS_FILE) if isinstance(r.get("metrics"), dict)]


def eval_curves(run_dir: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Each evaluated metric (TASK/METRIC, SOURCE/perplexity, …) as (steps, values) in step order; a step
    evaluated more than once keeps its latest result."""
    points: dict[str, dict[int, float]] = {}
    for record in eval_records(run_dir):
        for key, value in record["metrics"].items():
            if isinstance(value, int | float) and isinstance(record.get("step"), int):
                points.setdefault(key, {})[record["step"]] = value
    return {key: (sorted(by_step), [by_step[s] for s in sorted(by_step)]) for key, by_step in sorted(points.items())}


def newest_evals(run_dir: Path) -> dict[str, float]:
    """Each evaluated metric's value at the newest step it was evaluated at."""
    return {key: values[-1] for key, (_, values) in eval_curves(run_dir).items()}


def run_status(run_dir: Path, last_step: int | None, max_steps: int | None) -> tuple[str, str]:
    """(status, detail); see the module's docstring."""
    holder = lock_holder(run_dir)
    if holder is not None:
        return "running", f"pid {holder}" if holder else "on another node"
    attempts = attempt_records(run_dir)
    if attempts and attempts[-1].get("event") == "end":
        end = attempts[-1]
        if end.get("reason") == "preempted":
            return "preempted", f"{end.get('signal', 'a signal')} at step {end.get('step')}"
        return end.get("reason", "failed"), end.get("error", "")
    if attempts:
        return "failed", "killed (no end recorded)"
    if last_step is not None and max_steps is not None and last_step >= max_steps:
        return "complete", ""
    return "failed", "stopped before max_steps (no attempt record)"


def derived_max_steps(run_dir: Path) -> int | None:
    """The steps the latest attempt trained to, where config.toml says the length as max_epochs or max_tokens
    (the attempt's start record holds what they came to)."""
    starts = [r for r in attempt_records(run_dir) if r.get("event") == "start" and "max_steps" in r]
    return starts[-1]["max_steps"] if starts else None


def attempt_records(run_dir: Path) -> list[dict[str, Any]]:
    return json_lines(run_dir / ATTEMPTS_FILE)


def metric_records(run_dir: Path) -> list[dict[str, Any]]:
    return json_lines(run_dir / METRICS_FILE)


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The whole records of a JSON-lines file a run may be writing as we read (a torn last line is left out)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
        try:
            record = json.loads(line) if line.endswith("\n") else None
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def run_config(run_dir: Path) -> dict[str, Any]:
    """The run's saved config as plain TOML data (not validated: an old run still lists after a schema change);
    {} when there is none. One that is not UTF-8 TOML is a user error naming it rather than {}: read as empty,
    the run would pass for another (no length, the default checkpoint folder, no model to compare)."""
    path = run_dir / RUN_CONFIG
    fix = "restore it from a copy, or move the run directory out of the folder"
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise UserError(f"{path} cannot be read: {e.strerror}", fix) from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason})", fix) from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path} is not valid TOML: {e}", fix) from None


def config_differences(run_dirs: list[Path]) -> dict[str, list[Any]]:
    """`section.key` → each run's value, for the fields whose values are not all the same (None: not set)."""
    flat = [
        {
            f"{section}.{key}": value
            for section, fields in run_config(d).items()
            if isinstance(fields, dict)
            for key, value in fields.items()
        }
        for d in run_dirs
    ]
    table = {key: [f.get(key) for f in flat] for key in sorted(set().union(*flat))}
    return {key: values for key, values in table.items() if len({json.dumps(v) for v in values}) > 1}


def curves(run_dir: Path, x: Literal["steps", "tokens"] = "steps") -> dict[str, tuple[list[float], list[float]]]:
    """Each logged series of `CURVES` and of each MoE layer's load (`moe/{layer}/imbalance`) as (x, y), against
    the step or the tokens seen by then (`x="tokens"`). Every step trains on the same number of tokens, so an
    eval record's tokens are its step times that."""
    records = metric_records(run_dir)
    per_step = next((r["tokens_seen"] / r["step"] for r in reversed(records) if r.get("tokens_seen") and r["step"]), 0)
    scale = per_step if x == "tokens" else 1
    layer_loads = sorted(
        {key for r in records for key in r if LAYER_LOAD.fullmatch(key)}, key=lambda k: int(k.split("/")[1])
    )
    return {
        key: ([r["step"] * scale for r in points], [r[key] for r in points])
        for key in (*CURVES, *layer_loads)
        if (points := [r for r in records if r.get(key) is not None])
    }
