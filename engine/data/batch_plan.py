"""How many sequences each optimizer step trains on: the global batch, and its ramp.

A step's global batch is a whole number of micro-batches, each `train.batch_size` sequences on each of the
dp data-parallel ranks: the unit U = batch_size × dp. Without a ramp every step has the full global batch
G (train.global_batch_size, or batch_size × grad_accum_steps × dp). With a ramp (train.batch_ramp_start =
B0, batch_ramp_increment = I, k = (G - B0) / I rises over batch_ramp_steps or batch_ramp_tokens = L) the
batch grows linearly and is rounded down to the increment: at position x (steps done, or tokens trained
on before the step) it is B0 + I · min(k, floor(k · x / L)), and G from x = L on. B0, I and G are multiples
of U (the rules in engine/plan/length_rules.py), so a step's batch is always whole micro-batches, and it
is the same for every layout: the data order (engine.data.sampler) does not depend on the layout.

The plan is a list of segments (first step, sequences per step, samples before the first step), built once
in O(k); every question (sequences of step s, samples or tokens before it) is a bisection. Plain Python:
validate-config draws the ramp without torch.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config.job import JobConfig


@dataclass(frozen=True)
class Ramp:
    start: int  # sequences per step at the beginning
    increment: int  # sequences added at each rise
    length: int  # steps or tokens until the full global batch
    in_tokens: bool


class BatchPlan:
    def __init__(self, unit: int, full: int, seq_len: int, ramp: Ramp | None = None) -> None:
        assert unit > 0 and full % unit == 0, (unit, full)
        self.unit, self.full, self.seq_len, self.ramp = unit, full, seq_len, ramp
        self.segments = self._segments()
        self._firsts = [first for first, _, _ in self.segments]

    def _level(self, step: int, samples: int) -> int:
        r = self.ramp
        assert r is not None
        rises = (self.full - r.start) // r.increment
        position = samples * self.seq_len if r.in_tokens else step
        return min(rises, rises * position // r.length)

    def _segments(self) -> list[tuple[int, int, int]]:
        r = self.ramp
        if r is None:
            return [(0, self.full, 0)]
        rises = (self.full - r.start) // r.increment
        segments: list[tuple[int, int, int]] = []
        step = samples = 0
        while True:
            level = self._level(step, samples)
            sequences = r.start + level * r.increment
            segments.append((step, sequences, samples))
            if level == rises:
                return segments
            threshold = (level + 1) * r.length  # the next level begins where rises · position >= threshold
            if r.in_tokens:
                per_step = rises * sequences * self.seq_len
                steps = -(-(threshold - rises * samples * self.seq_len) // per_step)
            else:
                steps = -(-threshold // rises) - step
            samples += steps * sequences
            step += steps

    def _segment(self, step: int) -> tuple[int, int, int]:
        return self.segments[bisect_right(self._firsts, step) - 1]

    def sequences(self, step: int) -> int:
        """Sequences in 0-based optimizer step `step`, over all data-parallel ranks."""
        return self._segment(step)[1]

    def micro_batches(self, step: int) -> int:
        """Micro-batches each rank accumulates in step `step` (its accumulation steps)."""
        return self.sequences(step) // self.unit

    def samples_before(self, step: int) -> int:
        """Sequences trained on in steps 0 … step-1: where step `step` begins in the data stream."""
        first, sequences, samples = self._segment(step)
        return samples + (step - first) * sequences

    def tokens_before(self, step: int) -> int:
        return self.samples_before(step) * self.seq_len

    def tokens(self, step: int) -> int:
        return self.sequences(step) * self.seq_len

    def steps_for_tokens(self, tokens: int) -> int:
        """The fewest steps that train on at least `tokens` tokens: also the first step that begins with at
        least `tokens` tokens trained on before it."""
        for (first, sequences, samples), nxt in zip(self.segments, [*self._firsts[1:], None]):
            need = -(-(tokens - samples * self.seq_len) // (sequences * self.seq_len))
            if nxt is None or first + need <= nxt:
                return first + max(need, 0)
        raise AssertionError("the last segment is open-ended")

    def ramp_rows(self, max_steps: int) -> list[dict[str, int]]:
        """The ramp as validate-config shows it: per level its first step (counted from 1), sequences per step,
        micro-batches per rank and tokens trained on before it; only the levels inside the run."""
        return [
            {
                "step": first + 1,
                "sequences": sequences,
                "micro_batches": sequences // self.unit,
                "tokens_before": samples * self.seq_len,
            }
            for first, sequences, samples in self.segments
            if first < max_steps
        ]


def data_parallel(cfg: JobConfig, world_size: int) -> int:
    d = cfg.distributed
    return max(d.dp_replicate * d.resolved_dp_shard(world_size), 1)


def global_sequences(cfg: JobConfig, world_size: int, dp: int | None = None) -> int:
    """The full global batch in sequences: train.global_batch_size, or batch_size × grad_accum_steps × dp."""
    t = cfg.train
    if t.global_batch_size is not None:
        return t.global_batch_size
    return t.batch_size * (t.grad_accum_steps or 1) * (dp or data_parallel(cfg, world_size))


def batch_plan(cfg: JobConfig, world_size: int = 1, dp: int | None = None) -> BatchPlan:
    """The plan of a validated config (the rules guarantee that the sizes divide), for `world_size` processes
    (or `dp` data-parallel ranks, where the caller knows them)."""
    t = cfg.train
    dp = dp or data_parallel(cfg, world_size)
    ramp = None
    if t.batch_ramp_start is not None:
        in_tokens = t.batch_ramp_tokens is not None
        length = t.batch_ramp_tokens if in_tokens else t.batch_ramp_steps
        assert length is not None, "validation requires batch_ramp_steps or batch_ramp_tokens"
        ramp = Ramp(t.batch_ramp_start, t.batch_ramp_increment or t.batch_ramp_start, length, in_tokens)
    return BatchPlan(t.batch_size * dp, global_sequences(cfg, world_size, dp), t.seq_len, ramp)


def accumulation(cfg: JobConfig, world_size: int = 1) -> int:
    """Micro-batches per optimizer step at the full global batch: train.grad_accum_steps, or what
    train.global_batch_size comes to on the data-parallel ranks (engine/plan/length.py fills it in)."""
    if cfg.train.grad_accum_steps is not None:
        return cfg.train.grad_accum_steps
    plan = batch_plan(cfg, world_size)
    return plan.full // plan.unit


def tokens_per_step(cfg: JobConfig, world_size: int = 1) -> int:
    """Tokens one optimizer step trains on at the full global batch (after any ramp), summed over the
    data-parallel ranks."""
    return global_sequences(cfg, world_size) * cfg.train.seq_len
