"""Dataset mixtures: which source every sample of the training stream comes from.

`[[data.datasets]]` names the sources and their weights; `mix_temperature` T turns the weights w into
draw probabilities p_i = w_i^(1/T) / Σ_j w_j^(1/T) (T = 1: the weights as given, normalised; T → ∞:
uniform; T < 1 sharpens towards the heaviest source). `[[data.phases]]` (or the one-phase shorthand
`anneal_start_step` + `anneal_weights`) replaces the weights from a step on and multiplies the lr by its
`lr_scale`.

Sampling is a pure function of (data_seed, step, position in the global batch), like the single-source
stream (engine.data.sampler): step s draws the source of each of its G positions (G_s under a batch ramp) from numpy's Generator
seeded with (data_seed, MIX_STREAM, s) under the phase's probabilities. Source i keeps its own endless
shuffled stream (an `EpochOrder` seeded with (data_seed, i)); the k-th draw from source i in the whole run
takes position k of that stream, so a source that runs out starts a new shuffled epoch. Position k of the
draws at step s is the number of draws from i in steps < s plus those earlier in the same step; those counts
are replayed from step 0 once when a sampler starts (about 30 µs a step: a few seconds at 100k steps), then
kept up to date as it advances. So the samples of a step do not depend on the layout, and a resumed run
needs nothing but the step.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.config.data import DataConfig

MIX_STREAM = 0x6D6978  # "mix": keeps the source draws apart from the per-source permutations' seeds


def temperature_weights(weights: Sequence[float], temperature: float) -> np.ndarray:
    """w_i^(1/T) / Σ_j w_j^(1/T), computed through logs so large weights or small T do not overflow."""
    logs = np.log(np.asarray(weights, dtype=np.float64)) / temperature
    scaled = np.exp(logs - logs.max())
    return scaled / scaled.sum()


@dataclass(frozen=True)
class Phase:
    """From `start_step` on: each source's draw probability (0 for one the phase leaves out), lr multiplier."""

    start_step: int
    probabilities: tuple[float, ...]
    lr_scale: float


def mixture_phases(data: DataConfig) -> list[Phase]:
    """The phases of a validated `[data]` with datasets, the first starting at step 0 (the datasets' own
    weights unless a phase starts at 0)."""
    names = [s.name for s in data.datasets]

    def probabilities(weights: dict[str, float]) -> tuple[float, ...]:
        present = [n for n in names if n in weights]
        probs = dict(zip(present, temperature_weights([weights[n] for n in present], data.mix_temperature)))
        return tuple(float(probs.get(n, 0.0)) for n in names)

    phases = [Phase(0, probabilities({s.name: s.weight for s in data.datasets}), 1.0)]
    declared = [(p.start_step, p.dataset_weights, p.lr_scale) for p in data.phases]
    if data.anneal_start_step is not None and data.anneal_weights is not None:
        declared.append((data.anneal_start_step, data.anneal_weights, 1.0))
    for start, weights, scale in declared:
        if start == 0:
            phases.pop(0)
        phases.append(Phase(start, probabilities(weights), scale))
    return phases


def phase_index(phases: Sequence[Phase], step: int) -> int:
    return bisect_right([p.start_step for p in phases], step) - 1


def lr_scale(data: DataConfig) -> Callable[[int], float] | None:
    """step → the lr multiplier of its phase; None when no phase changes it (the schedule stays untouched)."""
    if not data.datasets:
        return None
    phases = mixture_phases(data)
    if all(p.lr_scale == 1.0 for p in phases):
        return None
    return lambda step: phases[phase_index(phases, step)].lr_scale


class SourceDraws:
    """Which source each position of each step's global batch draws from, and how many draws every source
    had before: the counts that turn a draw into a position of that source's own stream."""

    def __init__(self, phases: Sequence[Phase], global_batch: int | Callable[[int], int], seed: int) -> None:
        """`global_batch`: the positions of every step, or step → its positions (a batch ramp's sizes)."""
        self.phases, self.seed = list(phases), seed
        self.global_batch = global_batch if callable(global_batch) else lambda step: global_batch
        self.sources = len(self.phases[0].probabilities)
        self._step, self._before = 0, np.zeros(self.sources, dtype=np.int64)  # draws in steps < self._step

    def sources_of(self, step: int) -> np.ndarray:
        """int64 [global_batch(step)]: the source of every position of `step`."""
        probs = self.phases[phase_index(self.phases, step)].probabilities
        rng = np.random.default_rng([self.seed, MIX_STREAM, step])
        return rng.choice(self.sources, size=self.global_batch(step), p=probs)

    def before(self, step: int) -> np.ndarray:
        """int64 [sources]: draws from each source in steps 0 … step-1."""
        if step < self._step:
            self._step, self._before = 0, np.zeros(self.sources, dtype=np.int64)
        while self._step < step:
            self._before = self._before + np.bincount(self.sources_of(self._step), minlength=self.sources)
            self._step += 1
        return self._before

    def stream_positions(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, position in that source's stream) of every position of `step`'s global batch."""
        sources = self.sources_of(step)
        positions = self.before(step)[sources].copy()
        for i in range(self.sources):
            chosen = sources == i
            positions[chosen] += np.arange(int(chosen.sum()))
        return sources, positions


def phase_table(data: DataConfig, max_steps: int, tokens_before: Callable[[int], int]) -> list[dict]:
    """What validate-config shows: per phase its steps (counted from 1, as in the metrics), lr_scale, and per
    source the draw probability after temperature and the tokens it is expected to contribute (`tokens_before`:
    step → tokens trained on before it, engine.data.batch_plan)."""
    phases = mixture_phases(data)
    ends = [p.start_step for p in phases[1:]] + [max_steps]
    rows = []
    for phase, end in zip(phases, ends):
        tokens = tokens_before(end) - tokens_before(phase.start_step)
        rows.append(
            {
                "first_step": phase.start_step + 1,
                "last_step": end,
                "lr_scale": phase.lr_scale,
                "sources": {
                    s.name: {"probability": p, "tokens": round(p * tokens)}
                    for s, p in zip(data.datasets, phase.probabilities)
                },
            }
        )
    return rows
