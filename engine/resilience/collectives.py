"""Decisions every rank must take together (skip this step, stop now): one rank's view is not enough."""

from __future__ import annotations

import torch
import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when it is true on at least one; the local flag when there is no process group."""
    if not distributed():
        return flag
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
