"""Decisions every rank must take together (skip this step, stop now): one rank's view is not enough."""

from __future__ import annotations

import torch
import torch.distributed as dist


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
