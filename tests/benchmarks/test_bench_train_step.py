"""benchmarks/bench_train_step.py at toy size, so the script behind benchmarks/results/train_step_cpu.md cannot rot,
and its proof of precision (the dtype every linear layer produced) is shown to hold on both models. Its timings
are checked against what the test knows without the script's arithmetic: the tokens it asked for per step and
the time it measured around the whole run, which holds every timed step."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

BATCH, SEQ, WARMUP, STEPS = 2, 32, 1, 1
TIMED = ("forge", "transformers", "transformers_fused_adamw", "kernels_only")


def test_the_step_benchmark_runs_both_models_in_the_precision_asked_for(tmp_path: Path):
    out = tmp_path / "step.json"
    command = [sys.executable, "benchmarks/bench_train_step.py", "--dim", "64", "--n-layers", "1", "--n-heads", "4"]
    command += ["--n-kv-heads", "2", "--vocab-size", "512", "--batch-size", str(BATCH), "--seq-len", str(SEQ)]
    command += ["--rounds", "1", "--steps", str(STEPS), "--warmup", str(WARMUP), "--dtype", "bf16", "--out", str(out)]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["setup"]["linear_output_dtypes"] == {"forge": ["torch.bfloat16"], "transformers": ["torch.bfloat16"]}
    # Each timer's one timed step (its median) ran inside the run this test timed: together they fit in it.
    steps = [report[name]["median_step_sec"] for name in TIMED]
    assert all(s > 0 for s in steps) and sum(steps) < elapsed, (steps, elapsed)
    for name in TIMED:  # tokens/s is the tokens this test asked for per step over that step's time
        assert report[name]["tokens_per_sec"] * report[name]["median_step_sec"] == pytest.approx(BATCH * SEQ), name
        assert report[name]["tokens_per_sec"] > BATCH * SEQ * STEPS / elapsed, name
    ratio = report["transformers"]["median_step_sec"] / report["forge"]["median_step_sec"]
    assert report["ratio_forge_over_transformers"] == pytest.approx(ratio)
