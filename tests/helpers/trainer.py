"""Training through the engine API (no CLI) at a tiny size, and the fp32 tolerance of a run against its reference in other compute dtypes."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.config import load_job_config
from engine.train.callbacks import Callback
from engine.train.trainer import train

TINY = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "train.seq_len=64",
    "model.max_seq_len=64",
    "train.batch_size=4",
    "train.max_steps=4",
    "metrics.log_interval=1",
    "eval.enabled=false",
    "scheduler.warmup_steps=1",
]


def run(tmp_path: Path, name: str, *overrides: str, callbacks: Sequence[Callback] = ()) -> list[dict]:
    cfg = load_job_config(Path(__file__).parents[2] / "presets" / "debug.toml", [*TINY, *overrides])
    train(cfg, tmp_path / name, callbacks=callbacks)
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


class ComputeDtypes(Callback):
    """What each training forward computed the logits in: (autocast dtype in force or None when autocast is
    off, the output head's result dtype), from a forward hook on the head (outside any compiled block); and
    the largest root-mean-square of the logits, the scale of their rounding errors."""

    def __init__(self) -> None:
        self.seen: set[tuple[torch.dtype | None, torch.dtype]] = set()
        self.logits_rms = 0.0
        self.handle = None

    def before_step(self, step, loop) -> None:
        if self.handle is None:
            self.handle = loop.job.model.output.register_forward_hook(self.record)

    def record(self, module, args, out) -> None:
        self.seen.add((torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None, out.dtype))
        self.logits_rms = max(self.logits_rms, out.detach().float().square().mean().sqrt().item())


def rounding_tolerance(dtype: torch.dtype, logits_rms: float, tokens: int, steps: int, roundings: int = 3) -> float:
    """How far rounding alone may move a mean cross-entropy computed with `dtype` (bf16/fp16) matmuls from
    fp32's (or from another `dtype` run's that rounds elsewhere) over `steps` training steps.

    Derivation. A `dtype` value has p significant bits (bf16 8, fp16 11): rounding to nearest moves it by a
    relative error uniform in ±u, u = 2^-p (bf16 3.9e-3, fp16 4.9e-4), standard deviation u/√3. Each logit
    z = h·w of the output head goes through `roundings` such roundings (its input h, the weights w, the result
    z; inside a dot product each relative error moves z by about as much as when it hits z), so its error
    has standard deviation ≤ u·rms(z)·√(roundings/3). A token's loss, logsumexp(z) - z_label, moves by its
    label's error (the softmax-weighted mean of the others' errors is ~1/√vocab of it), and the mean over
    `tokens` independent tokens by σ = u·rms(z)·√(roundings/(3·tokens)). The blocks below the head (their
    own roundings reach the logits damped by the residual stream) and the updates, which carry one step's
    differences into the next, make this grow with the steps; allowed: linearly, steps·σ. The margin: 6 of
    those standard deviations (a normal deviate exceeds 6 with probability 2e-9)."""
    u = torch.finfo(dtype).eps / 2  # eps is the gap above 1, 2^(1-p)
    return 6 * steps * u * logits_rms * math.sqrt(roundings / (3 * tokens))
