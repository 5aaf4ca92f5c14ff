"""Save and load training state with torch.distributed.checkpoint (DCP).

Layout: CHECKPOINT_DIR/step_N/ holds one DCP checkpoint with the model and optimizer (through
`get_state_dict`, so the same code works for sharded models) and the train state (step, tokens seen,
LR scheduler). DCP writes per-rank shard files plus a `.metadata` file, and can load into a different
parallel layout than the one that saved.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

STEP_DIR = re.compile(r"^step_(\d+)$")
TRAIN_STATE = "train_state.json"


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
    """(step, path) of every step_N folder under root that DCP finished (it writes .metadata last), oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / ".metadata").is_file()]
    return sorted(found)


def save_checkpoint(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    train_state: dict[str, Any]) -> Path:
    """Write step_N. The JSON train state goes first and DCP's `.metadata` last, so a folder with
    `.metadata` is complete. Train state is JSON, not pickle, so loading it can never run code."""
    path = root / f"step_{step}"
    path.mkdir(parents=True, exist_ok=True)
    (path / TRAIN_STATE).write_text(json.dumps(train_state, indent=2))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with single_process_quiet():
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path, no_dist=not distributed())
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
    """Delete all but the newest `keep_last_n` complete checkpoints. `.metadata` goes first, so a deletion
    cut short leaves a folder that no longer counts as a complete checkpoint."""
    if keep_last_n is None:
        return
    for _, path in step_dirs(root)[:-keep_last_n]:
        (path / ".metadata").unlink()
        shutil.rmtree(path)
