"""Every random number generator's state as JSON, so a resumed run draws the same numbers (no pickle), for
each rank of a multi-process run: ranks draw differently (rank 0 alone builds the initial model), so each
resumes its own."""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from engine.resilience.collectives import distributed


def _encode(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "torch": _encode(torch.get_rng_state()),
        "cuda": [_encode(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_decode(state["torch"]))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_decode(s) for s in state["cuda"]])


def every_rank_rng_state() -> list[dict[str, Any]] | None:
    """Each rank's `rng_state()` in rank order, on rank 0 (what the checkpoint's train state holds); None on
    the other ranks. Every rank must call it."""
    state = rng_state()
    if not distributed():
        return [state]
    states: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(state, states, dst=0)
    return states


def restore_rank_rng(saved: list[dict[str, Any]] | dict[str, Any]) -> None:
    """Restore this rank's generators from `every_rank_rng_state()`'s list. A run resumed under another
    number of processes gives every rank rank 0's state, as do checkpoints written before per-rank states
    (they hold rank 0's alone)."""
    states = saved if isinstance(saved, list) else [saved]
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed() else (0, 1)
    restore_rng(states[rank] if len(states) == world else states[0])
