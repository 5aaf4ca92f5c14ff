"""The run directory: what `forge train` writes there (config, tokenizer files, metrics, train.log; the
checkpoints are engine.checkpoint's), the lock rank 0 holds while it writes, and how an existing one is
recognised and continued.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config.changes import resume_issues
from engine.config.job import JobConfig
from engine.config.loader import dump_toml, load_job_config, parse_override
from engine.durable import write_durably
from engine.errors import ConfigError, ConfigIssue, UserError
from engine.eval.rules import YAML_SUFFIXES
from engine.metrics.trackers import MetricsLogger, build_trackers
from engine.run_files import METRICS_FILE, RUN_CONFIG
from engine.run_lock import RunLock
from engine.runs import record_attempt

log = logging.getLogger("forge.train")


def run_config(run_dir: Path, overrides: list[str] = (), allow_code: bool = False) -> JobConfig:
    """The saved config of an existing run, with overrides (which `train` then checks are safe). The fields
    of it that would run code are refused unless `allow_code` (`refuse_saved_code`)."""
    if not (run_dir / RUN_CONFIG).is_file():
        raise UserError(
            f"{run_dir} is not a Forge run directory (it has no {RUN_CONFIG})",
            "pass the folder `forge train` wrote, e.g. runs/debug",
        )
    cfg = load_job_config(run_dir / RUN_CONFIG, overrides)
    refuse_saved_code(cfg, overrides, run_dir / RUN_CONFIG, allow_code)
    return cfg


def is_saved_config(path: Path) -> bool:
    """A config file named as the one training writes into a run directory: Forge reads it as a saved config
    (whoever wrote it), not as the user's preset."""
    return path.name == RUN_CONFIG


def refuse_saved_code(cfg: JobConfig, overrides: list[str], source: Path, allow_code: bool) -> None:
    """A saved config (a run directory's, maybe from someone else) runs no code unless the user asks on the
    command line: `--allow-code`, or the field set by an override of their own. Refused: a ConfigError naming
    each such field (exit 2), before anything is imported or written."""
    if allow_code:
        return
    fields = saved_code_fields(cfg, overrides)
    if fields:
        raise ConfigError(
            [
                ConfigIssue(
                    path,
                    f"{value!r} comes from the saved config {source}, and following it would run code from there",
                    f"pass --allow-code if you trust that run directory, or set {path.split('[')[0]} on the "
                    "command line (e.g. --train.hooks=[] or --eval.tasks=[])",
                )
                for path, value in fields
            ]
        )


def saved_code_fields(cfg: JobConfig, overrides: list[str]) -> list[tuple[str, str]]:
    """(field, value) of what in a saved config imports code: every `[[train.hooks]]` target, and each
    eval.tasks entry that is a task file rather than an installed task's name (lm-eval's `!function` imports
    the Python file beside it). A field an override sets is the user's own choice."""
    given = {".".join(parse_override(item)[0]) for item in overrides}
    fields = []
    if "train.hooks" not in given:
        fields += [(f"train.hooks[{i}].target", hook.target) for i, hook in enumerate(cfg.train.hooks)]
    if "eval.tasks" not in given and cfg.eval.enabled:
        fields += [(f"eval.tasks[{i}]", task) for i, task in enumerate(cfg.eval.tasks) if task.endswith(YAML_SUFFIXES)]
    return fields


def check_run_dir(cfg: JobConfig, run_dir: Path) -> bool:
    """A new run directory (False), or an existing run that `cfg` may continue (True; it resumes from its
    newest readable checkpoint, or from step 0 if it was killed before its first one)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} is a file", "pass --run-dir with a folder path")
    if (run_dir / RUN_CONFIG).is_file():
        issues = resume_issues(load_job_config(run_dir / RUN_CONFIG), cfg)
        if issues:
            raise ConfigError(issues, f"{run_dir} (an existing run: it resumes with its own config)")
        return True
    parent = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(
            f"cannot create run directory {run_dir}: {parent} is not writable", "pass --run-dir somewhere you can write"
        )
    return False


@dataclass
class RunOutputs:
    """Where a run's metrics go, and the run directory's lock while rank 0 writes it (other ranks: neither)."""

    trackers: MetricsLogger
    lock: RunLock | None = None
    run_dir: Path | None = None  # rank 0's: where the attempt's end is recorded
    checkpoint_lock: RunLock | None = None  # the lock on a checkpoint.dir outside the run directory

    def close(self, ending: dict[str, Any]) -> None:
        """Close the sinks, record how this attempt ended (`engine.runs`: complete, preempted or failed, with
        details), then let go of the lock, so that a reader who finds the lock free finds the record too."""
        try:
            self.trackers.close()  # may fail (a full disk): the end is recorded and the locks let go all the same
        finally:
            if self.run_dir is not None:
                try:
                    record_attempt(self.run_dir, "end", **ending)
                except OSError as err:  # a full disk must not hide why the run ended
                    log.warning("could not record the end of this attempt in %s: %s", self.run_dir, err)
            for lock in (self.checkpoint_lock, self.lock):
                if lock is not None:
                    lock.release()
            self.lock = self.checkpoint_lock = None


def open_run_dir(
    cfg: JobConfig,
    run_dir: Path,
    train_data: Any,
    start_step: int,
    wandb_run_id: str | None,
    max_steps: int | None = None,
    checkpoint_dir: Path | None = None,
) -> RunOutputs:
    """Write the run directory and start the metric sinks. A sink that cannot start (W&B not logged in,
    TensorBoard missing) is a user error: then whatever this call created is removed again. `checkpoint_dir`:
    a checkpoint folder outside the run directory, locked as the run directory is (two runs never share it)."""
    created = not run_dir.exists()
    before = set() if created else set(run_dir.iterdir())
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock.acquire(run_dir)  # before anything is written; in use: nothing here is ours
    checkpoint_lock = None
    try:
        if checkpoint_dir is not None:
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
            checkpoint_lock = RunLock.acquire(checkpoint_dir)
        resumed_from = start_step if (run_dir / METRICS_FILE).exists() and not created else None
        # The sinks first: they check what the run holds (a corrupt metrics.jsonl, W&B not logged in), and a
        # refused resume must leave config.toml as it was, since `forge runs` and the next resume read it.
        trackers = build_trackers(cfg, run_dir, run_dir.name, resumed_from, wandb_run_id)
        outputs = RunOutputs(trackers, lock, run_dir, checkpoint_lock)
        try:
            write_if_changed(run_dir / RUN_CONFIG, dump_toml(cfg).encode())
            if train_data.tokenizer_file is not None:
                write_if_changed(run_dir / "tokenizer.json", train_data.tokenizer_file.read_bytes())
                # The end-of-text token the shards were made with, where Hugging Face tools (and our export and
                # generate) look for it: a vocabulary can hold several candidates.
                eos = json.dumps({"eos_token": train_data.manifest.eos_token}, indent=2) + "\n"
                write_if_changed(run_dir / "tokenizer_config.json", eos.encode())
            # max_steps: what this attempt trains to, also where config.toml leaves it to max_epochs or max_tokens
            record_attempt(run_dir, "start", step=start_step, **({"max_steps": max_steps} if max_steps else {}))
        except BaseException:
            outputs.trackers.close()
            raise
        return outputs
    except UserError:
        for path in [run_dir] if created else set(run_dir.iterdir()) - before:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        for held in (checkpoint_lock, lock):
            if held is not None:
                held.release()
        raise


def write_if_changed(path: Path, content: bytes) -> None:
    """A resume rewrites nothing it need not; what it does rewrite is replaced atomically, since the run's
    config is what a later resume reads."""
    if not path.is_file() or path.read_bytes() != content:
        write_durably(path, content)


@contextlib.contextmanager
def logging_to(path: Path) -> Iterator[None]:
    """Forge's log lines (training, checkpoints, resilience) also go to the run's train.log."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    forge_log = logging.getLogger("forge")
    forge_log.addHandler(handler)
    forge_log.setLevel(logging.INFO)
    try:
        yield
    finally:
        forge_log.removeHandler(handler)
        handler.close()
