"""Parity checks: two computations that must agree (one process and several, ours and `transformers`/`peft`/
torchtitan/a reference optimizer, a closed form), each deviation compared with a tolerance derived from the
computation, and the largest one recorded.

A test asks for the `parity` fixture (tests/conftest.py), which marks it `parity` (`pytest -m parity` runs
them all) and fails it if it compared nothing. With FORGE_PARITY_LOG=FILE each comparison appends one JSON
line {test, what, deviation, tolerance, used} to FILE; benchmarks/parity_capabilities.py runs the parity tests
under every ATEN_CPU_CAPABILITY and tabulates those lines.

How the tolerances are derived (the constants below):
- float64, where the claim is that two algorithms compute the same function (multi-process layouts against
  one process, merged against unmerged weights): rounding differs by reduction order only, so each result
  differs by a few units of float64's roundoff U64 = 2^-53 ≈ 1.1e-16 times the size of what is summed, times
  the growth through a few optimizer steps (below). FP64_TOL = 1e-10 is 10^6 · U64: for values of order 1 it
  leaves more than 1000× room over the largest deviation measured (1e-14) and is 10^6 times below what any
  real fault moves (a lost reduction, a wrong mask or position changes a loss by > 1e-4).
- float32, where a reference we did not write computes in fp32: the tolerance is k · U32 · scale with
  U32 = 2^-24 ≈ 6e-8, k the number of rounding steps whose order may differ (reduction lengths, layers), and
  the scale the size of the compared values; each test says its k and scale.
- Several AdamW steps: a deviation δ in a gradient entry g changes that entry's update lr·m̂/(√v̂+ε) by about
  lr·δ/|g|, so weights drift apart by lr · steps · (relative gradient deviation), and the losses of later
  steps by |∂loss/∂w| times that drift. Relative deviations of gradients stay near the roundoff (1e-14 in
  float64 at these sizes) except for entries whose gradient cancels to near zero, which is why the weight
  comparisons are run in float64, where even a 10^4-fold amplification stays under FP64_TOL.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch

U32 = 2.0**-24  # float32 unit roundoff
U64 = 2.0**-53  # float64 unit roundoff
FP64_TOL = 1e-10  # see the module docstring


@dataclass
class Parity:
    """One test's comparisons: `close` for tensors, `within` for a deviation measured elsewhere (a script run
    under torchrun). Every comparison is recorded, then asserted."""

    test: str
    records: list[dict] = field(default_factory=list)

    def within(self, what: str, deviation: float, tolerance: float) -> None:
        """Record `deviation` (≥ 0) and assert it is at most `tolerance`."""
        deviation, tolerance = float(deviation), float(tolerance)
        self.log(what, deviation, tolerance, deviation / tolerance if tolerance else float(deviation > 0))
        assert deviation <= tolerance, f"{self.test} {what}: deviation {deviation:.3g} > tolerance {tolerance:.3g}"

    def close(self, actual, expected, *, atol: float, rtol: float = 0.0, what: str = "values") -> None:
        """torch.testing.assert_close(actual, expected, atol, rtol) on tensors or (nested) lists/dicts of them,
        recording the largest |actual - expected| and the largest share of the allowed atol + rtol·|expected|."""
        pairs = list(flatten(actual, expected))
        assert pairs, f"{what}: nothing to compare"
        deviation, used = 0.0, 0.0
        for x, y in pairs:
            a, e = torch.as_tensor(x).detach(), torch.as_tensor(y).detach()
            if a.numel() and a.shape == e.shape and a.dtype == e.dtype:
                gap = (a.double() - e.double()).abs()
                deviation = max(deviation, gap.max().item())
                allowed = atol + rtol * e.double().abs()
                used = max(used, (gap / allowed).max().item() if (allowed > 0).all() else float(gap.max() > 0))
        self.log(what, deviation, {"atol": float(atol), "rtol": float(rtol)}, used)
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")

    def log(self, what: str, deviation: float, tolerance, used: float) -> None:
        record = {"test": self.test, "what": what, "deviation": deviation, "tolerance": tolerance, "used": used}
        self.records.append(record)
        if path := os.environ.get("FORGE_PARITY_LOG"):
            with open(path, "a") as f:  # one short line per write: the xdist workers' appends do not interleave
                f.write(json.dumps(record) + "\n")


def fp32_bound(scale: float, length: int, depth: int) -> float:
    """Tolerance for two fp32 evaluations of one function whose reduction orders differ (another kernel,
    W + BA against Wx + B(Ax), another library): a sum of n terms computed in any order is within n·U32 of
    the exact sum, relative to the sum of the terms' sizes (the standard bound γ_n, Higham, "Accuracy and
    Stability of Numerical Algorithms" §3.1); `length` is the longest reduction, `depth` the number of
    reductions in sequence on the way to a compared value (their relative errors add; norms and softmax do
    not amplify them), and `scale` the largest compared |value|, standing for the sum of the terms' sizes.
    Both computations may err, hence the 2."""
    return float(2 * depth * length * U32 * scale)


def model_bound(cfg, scale: float, *, backward: bool = False, extra: int = 0) -> float:
    """fp32_bound for a Transformer's logits (or, `backward`, its gradients): per block the reductions in
    sequence are the attention norm, the q/k/v projections, the scores, softmax, scores·v, the output
    projection, the FFN norm, w1/w3 and w2 (9), then the final norm and the head; backward runs as many again
    (and sums over the vocabulary). `extra`: reductions the comparison adds (a LoRA path)."""
    depth = 9 * cfg.n_layers + 2 + extra
    length = max(cfg.dim, cfg.ffn_dim, cfg.max_seq_len, cfg.vocab_size if backward else 0)
    return fp32_bound(scale, length, 2 * depth if backward else depth)


SIGMAS = 6  # a Gaussian deviation beyond 6σ has probability 2e-9


def rounding_sigma(lengths: list[int]) -> float:
    """Relative standard deviation of a value computed in fp32 through reductions of these lengths when their
    order changes: each rounding an independent error uniform in ±U32 (variance U32²/3) relative to the
    terms' sizes, so σ = U32·√(Σn/3) (the statistical model of Higham & Mary, "A new approach to probabilistic
    rounding error analysis", SIAM J. Sci. Comput. 2019; its worst case, fp32_bound, is vacuous over steps)."""
    return U32 * math.sqrt(sum(lengths) / 3)


def forward_lengths(cfg, seq: int) -> list[int]:
    """The reductions on the way to one token's loss: per block the two norms, q, k, v, o and the FFN's w1 and
    w3 over dim, the scores over head_dim, softmax and scores·v over ≤ seq keys, w2 over the FFN width (a
    mixture-of-experts block adds its router over dim and the sum of the chosen and shared experts); then the
    final norm and the head over dim, and the log-sum-exp over the vocabulary."""
    head_dim = cfg.dim // cfg.n_heads
    block = [cfg.dim] * 8 + [head_dim, seq, seq, cfg.ffn_dim]
    if cfg.num_experts:
        block += [cfg.dim, cfg.moe_top_k + cfg.moe_shared_experts]
    return block * cfg.n_layers + [cfg.dim, cfg.dim, cfg.vocab_size]


def logits_tolerance(cfg, seq: int, scale: float) -> float:
    """Two fp32 evaluations of a model's logits by different code (another library's kernels and sums): by the
    statistical rounding model each logit is off by σ = rounding_sigma of the forward's reductions
    (forward_lengths) relative to the logits' size `scale`; both computations err, hence SIGMAS·√2·σ·scale.
    At the tests' sizes ~20× under model_bound's worst case (which a real fault of 1e-4 of a logit passes)."""
    return SIGMAS * math.sqrt(2) * rounding_sigma(forward_lengths(cfg, seq)) * scale


@dataclass
class TrainingTolerance:
    """Tolerances for two fp32 runs of the same training steps (one process against a layout), from the
    statistical rounding model (rounding_sigma) and how deviations grow over AdamW steps:
    - loss of step k: the mean over `tokens` token losses, each off by σ_f·|loss| (forward reductions; both
      runs deviate: ×√2) → SIGMAS·√2·σ_f·|loss|/√tokens; the weights' drift over the k − 1 steps before adds
      a deviation of the same order each step (a step is a Lipschitz map of the weights at these learning
      rates), so ×k;
    - relative gradient norm: σ_n = the forward's reductions twice (backward), the sum over the step's tokens
      and the norm's own sum over all `params` entries: SIGMAS·√2·σ_n·k;
    - gradients (relative to the largest entry): δ = SIGMAS·√2·σ_b, σ_b without the norm's sum;
    - weights: AdamW moves an entry by lr·m̂/(√v̂+ε); a relative deviation δ of its gradient changes that by at
      most 2δ·lr, summed over the steps' learning rates; and
      each step rounds the stored fp32 weight, which two runs may do to neighbouring values: 2·U32·max|w|
      per step."""

    loss: float
    norm: float
    grad: float

    @classmethod
    def of(cls, cfg, *, seq: int, tokens: int, params: int, loss_scale: float) -> TrainingTolerance:
        forward = forward_lengths(cfg, seq)
        backward = [*forward, *forward, tokens]
        sigma_f, sigma_b, sigma_n = (rounding_sigma(n) for n in (forward, backward, [*backward, params]))
        step = SIGMAS * math.sqrt(2)
        return cls(step * sigma_f * loss_scale / math.sqrt(tokens), step * sigma_n, step * sigma_b)

    @classmethod
    def of_run(cls, cfg) -> TrainingTolerance:
        """For a one-process run of JobConfig `cfg`: its sizes, the loss scale ln(vocab)."""
        from engine.model.estimate import param_counts

        tokens = cfg.train.seq_len * cfg.train.batch_size * cfg.train.grad_accum_steps
        params = param_counts(cfg.model)["total"]
        return cls.of(
            cfg.model, seq=cfg.train.seq_len, tokens=tokens, params=params, loss_scale=math.log(cfg.model.vocab_size)
        )

    def loss_at(self, step: int) -> float:
        return self.loss * step

    def norm_at(self, step: int) -> float:
        return self.norm * step

    def weights(self, lrs: list[float], largest: float) -> float:
        """After steps of these learning rates, for weights of at most `largest` in size."""
        return 2 * self.grad * sum(lrs) + len(lrs) * 2 * U32 * largest


def flatten(actual, expected):
    """Pairs of tensors (or numbers) at the same place in two nests of dicts/lists/tuples."""
    if isinstance(actual, dict):
        for key in actual:
            yield from flatten(actual[key], expected[key])
    elif isinstance(actual, list | tuple):
        for a, e in zip(actual, expected):
            yield from flatten(a, e)
    else:
        yield actual, expected
