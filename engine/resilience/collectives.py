"""Decisions every rank must take together (skip this step, stop now): one rank's view is not enough."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from engine.errors import UserError

T = TypeVar("T")


def distributed() -> bool:
    """Whether a process group is up; without one every decision (and DCP's reads and writes) is this process's."""
    return dist.is_available() and dist.is_initialized()


def any_rank(flag: bool, device: torch.device, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank when it is true on at least one; the local flag when there is no process group."""
    if not distributed():
        return flag
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def every_rank(flag: bool, device: torch.device, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank when it is true on all of them; the local flag when there is no process group."""
    return not any_rank(not flag, device, group)


def on_rank0(attempt: Callable[[], T], fallback: T, device: torch.device, what: str) -> T:
    """Run `attempt` on rank 0 alone, and every rank learns whether it worked: a failure raises on every rank
    (rank 0's own error there, a pointer to it elsewhere) instead of leaving the others waiting for rank 0 in
    their next collective until the timeout. → `attempt`'s result on rank 0, `fallback` on the others;
    without a process group, just `attempt()`. `what` completes "rank 0 could not …"."""
    result, failure = fallback, None
    if not distributed() or dist.get_rank() == 0:
        try:
            result = attempt()
        except Exception as err:  # any failure: the other ranks must not wait for rank 0 in a collective
            failure = err
    if any_rank(failure is not None, device):
        raise failure or UserError(f"rank 0 could not {what}", "see rank 0's error above")
    return result
