"""Collective health: a small all-reduce with a deadline, so a hung rank stops the run instead of
freezing every other rank until the scheduler's time limit."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class CollectiveTimeout(RuntimeError):
    """A health-check all-reduce did not finish in time."""


def check_collectives(timeout_sec: float, device: torch.device, monitor_group=None) -> None:
    """All ranks reach a monitored barrier on the gloo `monitor_group` (rank 0 learns which ranks did
    not arrive), then time an all-reduce on the training backend. Raise `CollectiveTimeout` naming the
    rank that saw the problem, and the missing ranks when gloo can tell."""
    rank, timeout = dist.get_rank(), datetime.timedelta(seconds=timeout_sec)
    if monitor_group is not None:
        try:
            dist.monitored_barrier(monitor_group, timeout=timeout, wait_all_ranks=True)
        except RuntimeError as err:
            raise CollectiveTimeout(
                f"rank {rank}: health-check barrier failed after {timeout_sec:g} s: {err}"
            ) from None
    probe = torch.ones(1, device=device)
    work = dist.all_reduce(probe, async_op=True)
    try:
        finished = work.wait(timeout=timeout)
    except RuntimeError as err:
        raise CollectiveTimeout(
            f"rank {rank}: health-check all-reduce did not finish in {timeout_sec:g} s: {err}"
        ) from None
    if finished is False or probe.item() != dist.get_world_size():
        raise CollectiveTimeout(
            f"rank {rank}: health-check all-reduce returned {probe.item()}, "
            f"expected the world size {dist.get_world_size()}"
        )
