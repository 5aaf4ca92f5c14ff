"""How the processes of a multi-process evaluation share the work: each answers every `size`-th piece, and all
of them gather every answer.

The pieces are the same on every process (a batch of rows the scorer laid out from all the requests, or one
generation), so a piece's answer is computed on the same inputs with the same shapes as in one process: the
results are the ones one process gets, bit for bit, whatever the number of processes. Every process then
holds every answer, and the harness's bookkeeping (metrics, stderr) runs on each as it would alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class WorkSplit:
    """This process is `rank` of `size` sharing an evaluation (size 1: it does everything)."""

    rank: int = 0
    size: int = 1

    def mine(self, pieces: int) -> range:
        """The indices of the pieces this process computes, of `pieces` in all: rank, rank + size, …"""
        return range(self.rank, pieces, self.size)

    def gather(self, answers: dict[int, T]) -> dict[int, T]:
        """Every process's answers (piece index → answer), on every process. Collective: every process of the
        default process group calls it the same number of times."""
        if self.size == 1:
            return answers
        parts: list[dict[int, T] | None] = [None] * self.size
        dist.all_gather_object(parts, answers)
        return {index: answer for part in parts for index, answer in (part or {}).items()}

    def wait(self) -> None:
        """A barrier over the processes (none alone)."""
        if self.size > 1:
            dist.barrier()

    def from_first(self, value: T) -> T:
        """Rank 0's `value`, on every process (collective)."""
        if self.size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


ALONE = WorkSplit()


def process_split() -> WorkSplit:
    """Every process of the default process group takes part (one process without one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return ALONE
    return WorkSplit(dist.get_rank(), dist.get_world_size())
