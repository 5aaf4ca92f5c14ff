"""Save and load training state with torch.distributed.checkpoint (DCP).

Layout under the checkpoint folder:

    step_N/            one checkpoint: DCP shard files + .metadata (model and optimizer, through
                       `get_state_dict`, so the same code serves sharded models), train_state.json
                       (step, tokens seen, LR scheduler, RNG states; JSON, never pickle), and COMPLETE,
                       written last, after every other file is on disk (fsync)
    latest             the name of the newest complete checkpoint, replaced atomically after COMPLETE
                       (for people and tools; Forge itself resumes from the newest folder with COMPLETE,
                       which is the same one unless `latest` was lost)

A folder without COMPLETE was cut short (the job was killed while saving) and is never loaded. DCP can
load a checkpoint into a different parallel layout than the one that saved it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from engine.durable import fsync_file, write_durably

STEP_DIR = re.compile(r"^step_(\d+)$")
TRAIN_STATE = "train_state.json"
COMPLETE = "COMPLETE"
LATEST = "latest"

log = logging.getLogger("forge.checkpoint")


def distributed() -> bool:
    """Whether a process group is up: without one DCP reads and writes everything from this process."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns whenever one process saves or loads alone, which is exactly what we ask for without a group."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step_N folder under root, complete or not, oldest first."""
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    return [(step, path) for step, path in step_dirs(root) if (path / COMPLETE).is_file()]


def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint; newer incomplete ones (a save that was killed) are skipped with a warning."""
    complete = complete_checkpoints(root)
    newest = complete[-1] if complete else None
    for step, path in step_dirs(root):
        if newest is None or step > newest[0]:
            log.warning("skipping incomplete checkpoint %s (its save was interrupted)", path)
    return newest


def save_checkpoint(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    train_state: dict[str, Any]) -> Path:
    """Write step_N durably, then mark it complete, then point `latest` at it."""
    path = root / f"step_{step}"
    if path.exists():  # a save of this step that was cut short by a kill
        shutil.rmtree(path)
    path.mkdir(parents=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with single_process_quiet():
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path, no_dist=not distributed())
    (path / TRAIN_STATE).write_text(json.dumps(train_state))
    for file in path.iterdir():
        fsync_file(file)
    write_durably(path / COMPLETE, "")
    write_durably(root / LATEST, path.name)
    return path


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load the model (and the optimizer, when given) in place; return the saved train state."""
    optimizers = [optimizer] if optimizer is not None else []
    model_sd, optim_sd = get_state_dict(model, optimizers)
    state = {"model": model_sd, **({"optimizer": optim_sd} if optimizers else {})}
    with single_process_quiet():
        dcp.load(state, checkpoint_id=path, no_dist=not distributed())
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state.get("optimizer", {}))
    return json.loads((path / TRAIN_STATE).read_text())


def prune_checkpoints(root: Path, keep_last_n: int | None) -> None:
    """Delete all but the newest `keep_last_n` complete checkpoints (and incomplete folders older than the
    newest complete one). COMPLETE goes first, so a deletion cut short never leaves a loadable half."""
    if keep_last_n is None:
        return
    complete = complete_checkpoints(root)
    keep = {path for _, path in complete[-keep_last_n:]}
    newest = complete[-1][0] if complete else -1
    for step, path in step_dirs(root):
        if path not in keep and step < newest:
            (path / COMPLETE).unlink(missing_ok=True)
            shutil.rmtree(path)
