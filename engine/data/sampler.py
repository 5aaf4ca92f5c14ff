"""The order in which samples are used, and which of them each micro-step of each rank gets.

The training order is an endless stream of sample indices: epoch e is a permutation of all samples drawn
from numpy's Generator seeded with (data_seed, e), and the next epoch follows when the data runs out.
Optimizer step s uses the G = batch_size × grad_accum_steps × dp_size consecutive stream positions from
s × G, and micro-step m of data-parallel rank r takes the batch_size positions from s × G + (m × dp_size + r)
× batch_size. So the samples of a step do not depend on how they are split over ranks and micro-steps, and
resuming at step s needs nothing but s. Under a batch ramp (engine.data.batch_plan) step s has its own G_s, a
whole number of micro-steps, and begins at the plan's samples before it instead of s × G: the same rule.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import count

import numpy as np
from torch.utils.data import Sampler

from engine.data.batch_plan import BatchPlan
from engine.data.mixture import SourceDraws


@dataclass(frozen=True)
class BatchLayout:
    """How one optimizer step's samples are split: per-device batch, micro-steps, data-parallel ranks."""

    batch_size: int
    grad_accum_steps: int = 1
    dp_size: int = 1
    dp_rank: int = 0
    plan: BatchPlan | None = None  # a batch ramp: the steps' sizes differ (grad_accum_steps is the full batch's)

    def __post_init__(self) -> None:
        assert self.batch_size > 0 and self.grad_accum_steps > 0 and 0 <= self.dp_rank < self.dp_size

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.grad_accum_steps * self.dp_size

    def step_sequences(self, step: int) -> int:
        """Samples in optimizer step `step` over all ranks."""
        return self.global_batch if self.plan is None else self.plan.sequences(step)

    def micro_steps(self, step: int) -> int:
        """Micro-steps of optimizer step `step` (0-based)."""
        return self.grad_accum_steps if self.plan is None else self.plan.micro_batches(step)

    def step_start(self, step: int) -> int:
        """Stream position of the first sample of optimizer step `step`."""
        return step * self.global_batch if self.plan is None else self.plan.samples_before(step)

    def micro_batch_start(self, step: int, micro_step: int) -> int:
        """Stream position of this rank's first sample in micro-step `micro_step` of optimizer step `step`."""
        return self.step_start(step) + (micro_step * self.dp_size + self.dp_rank) * self.batch_size


class EpochOrder:
    """The endless shuffled stream: position p is sample permutation(epoch = p // n)[p % n]."""

    def __init__(self, num_samples: int, seed: int | tuple[int, ...]) -> None:
        assert num_samples > 0
        self.num_samples, self.seed = num_samples, seed
        self._key = list(seed) if isinstance(seed, tuple) else [seed]
        self._cache: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            if len(self._cache) >= 2:  # a batch spans at most two epochs when it is smaller than the data
                self._cache.pop(min(self._cache))
            self._cache[epoch] = np.random.default_rng([*self._key, epoch]).permutation(self.num_samples)
        return self._cache[epoch]

    def take(self, position: int, count: int) -> np.ndarray:
        """The sample indices at stream positions [position, position + count)."""
        out = np.empty(count, dtype=np.int64)
        filled = 0
        while filled < count:
            epoch, offset = divmod(position + filled, self.num_samples)
            chunk = self.permutation(epoch)[offset : offset + count - filled]
            out[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
        return out


class TrainBatchSampler(Sampler[list[int]]):
    """Endless: this rank's sample indices for every micro-step from optimizer step `start_step` on."""

    def __init__(self, order: EpochOrder, layout: BatchLayout, start_step: int = 0) -> None:
        assert start_step >= 0
        self.order, self.layout, self.start_step = order, layout, start_step

    def __iter__(self) -> Iterator[list[int]]:
        for step in count(self.start_step):
            for micro in range(self.layout.micro_steps(step)):
                yield self.order.take(self.layout.micro_batch_start(step, micro), self.layout.batch_size).tolist()


class MixtureBatchSampler(Sampler[list[int]]):
    """Endless, for a mixture (engine.data.mixture): this rank's indices into the concatenated sources' windows
    for every micro-step from optimizer step `start_step` on. Positions of a step's global batch are split
    over ranks and micro-steps exactly as TrainBatchSampler splits them."""

    def __init__(
        self,
        draws: SourceDraws,
        orders: Sequence[EpochOrder],
        offsets: Sequence[int],
        layout: BatchLayout,
        start_step: int = 0,
    ) -> None:
        assert start_step >= 0 and draws.global_batch(start_step) == layout.step_sequences(start_step)
        self.draws, self.orders, self.offsets = draws, list(orders), list(offsets)
        self.layout, self.start_step = layout, start_step

    def __iter__(self) -> Iterator[list[int]]:
        size = self.layout.batch_size
        for step in count(self.start_step):
            sources, positions = self.draws.stream_positions(step)
            for micro in range(self.layout.micro_steps(step)):
                first = self.layout.micro_batch_start(step, micro) - self.layout.step_start(step)
                yield [
                    self.offsets[source] + int(self.orders[source].take(int(position), 1)[0])
                    for source, position in zip(sources[first : first + size], positions[first : first + size])
                ]


class EvalBatchSampler(Sampler[list[int]]):
    """The same `steps` micro-batches on every pass: the first samples in file order, spread over ranks
    like one optimizer step with `steps` micro-steps, wrapping around when the held-out set is smaller.

    steps = "all": every sample once. The samples are cut into chunks of batch_size in file order (the last
    may be shorter) and chunk c goes to data-parallel rank c mod dp; every rank runs as many batches (a
    sharded model's forwards are collective), so a rank with no chunk left repeats its first with weight 0.
    `weights` are the real rows of each of this rank's batches: a token-weighted mean over all ranks is the
    mean over every window, as one process computes it."""

    def __init__(self, num_samples: int, layout: BatchLayout, steps: int | str) -> None:
        assert num_samples > 0 and (steps == "all" or (isinstance(steps, int) and steps > 0))
        self.num_samples, self.layout, self.steps = num_samples, layout, steps
        self.batches, self.weights = self._plan()

    def _plan(self) -> tuple[list[list[int]], list[int]]:
        size, dp, rank = self.layout.batch_size, self.layout.dp_size, self.layout.dp_rank
        if self.steps != "all":
            batches = []
            for micro in range(int(self.steps)):
                start = self.layout.micro_batch_start(0, micro)
                batches.append((np.arange(start, start + size) % self.num_samples).tolist())
            return batches, [size] * len(batches)
        chunks = [list(range(a, min(a + size, self.num_samples))) for a in range(0, self.num_samples, size)]
        rounds = -(-len(chunks) // dp)
        mine = chunks[rank::dp]
        filler = mine[0] if mine else chunks[0]
        return mine + [filler] * (rounds - len(mine)), [len(c) for c in mine] + [0] * (rounds - len(mine))

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)
