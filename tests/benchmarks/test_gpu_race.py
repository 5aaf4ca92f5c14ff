"""benchmarks/gpu_race.py at toy size on CPU, so the GPU race against torchtitan cannot rot between GPU sessions.
Its figures are checked against measurements the test makes itself: tokens/s against the time it measured
around the run, MFU against the FLOPs torch's FlopCounterMode counts in one training step of the same model,
peak memory against the child's peak resident set as the kernel reports it when the child is reaped."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.gpu_race import TOY
from engine.config.loader import load_job_config
from engine.metrics.mfu import peak_flops
from engine.model import build_model
from engine.train.losses import build_loss
from tests.conftest import REPO

BATCH, SEQ, STEPS = 2, 32, 2


def counted_flops_per_token() -> float:
    """FLOPs of one forward + backward of the toy model, counted by torch per matmul; SDPA's math backend spells
    attention as matmuls the counter sees (its fused CPU kernel is not in the counter's table)."""
    cfg = load_job_config(REPO / "presets" / "1b.toml", [*TOY, f"--train.seq_len={SEQ}", f"--train.batch_size={BATCH}"])
    tokens = torch.randint(0, cfg.model.vocab_size, (BATCH, SEQ + 1))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        build_loss(cfg.train)(build_model(cfg.model), tokens[:, :-1], tokens[:, 1:]).backward()
    return counter.get_total_flops() / (BATCH * SEQ)


def test_gpu_race_runs_both_frameworks_on_the_same_shape(tmp_path: Path):
    out = tmp_path / "race.json"
    command = [sys.executable, "benchmarks/gpu_race.py", "--device", "cpu", "--toy", "--modes", "bf16"]
    command += ["--steps", str(STEPS), "--warmup", "1", "--seq-len", str(SEQ), "--batch-size", str(BATCH)]
    start = time.perf_counter()
    child = subprocess.Popen([*command, "--out", str(out)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = child.stderr.read().decode()
    _, status, usage = os.wait4(child.pid, 0)  # the child's own rusage, not the largest of all children so far
    elapsed = time.perf_counter() - start
    assert os.waitstatus_to_exitcode(status) == 0, stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["results"]) == ["bf16"] and report["setup"]["torchtitan"] != "unknown"
    bf16 = report["results"]["bf16"]
    flops, peak = counted_flops_per_token(), peak_flops(torch.device("cpu"), torch.bfloat16)
    peak_rss_gib = usage.ru_maxrss * 1024 / 2**30  # Linux reports kilobytes
    for side in ("forge", "torchtitan"):
        run = bf16[side]
        assert run["parameters"] == bf16["expected_parameters"] > 0, side  # the same shape on both sides
        assert run["mfu"] == pytest.approx(flops * run["tokens_per_sec"] / peak, rel=1e-9), (run, flops, peak)
        # RSS only grows: each side's peak lies below the child's final one, and above half of it (the
        # imported libraries, most of it, were resident before either side was measured)
        assert peak_rss_gib / 2 < run["peak_memory_gib"] <= peak_rss_gib, (run, peak_rss_gib)
        assert math.isfinite(run["first_loss"]) and math.isfinite(run["last_loss"]), run
        assert abs(run["first_loss"] - math.log(256)) < 1.5, run  # vocab 256: near-uniform predictions at first
        assert run["tokens_per_sec"] * run["median_step_sec"] == pytest.approx(BATCH * SEQ), run  # tokens asked for
    # the STEPS timed steps of both sides ran inside `elapsed` (of two steps, the median is their mean)
    step_seconds = [bf16[side]["median_step_sec"] for side in ("forge", "torchtitan")]
    assert min(step_seconds) > 0 and STEPS * sum(step_seconds) < elapsed, (step_seconds, elapsed)
    ratio = bf16["forge"]["tokens_per_sec"] / bf16["torchtitan"]["tokens_per_sec"]
    assert bf16["forge_over_torchtitan_tokens_per_sec"] == pytest.approx(ratio)
