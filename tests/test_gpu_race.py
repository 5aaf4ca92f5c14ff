"""benchmarks/gpu_race.py at toy size on CPU, so the GPU race against torchtitan cannot rot between GPU sessions."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_gpu_race_runs_both_frameworks_on_the_same_shape(tmp_path: Path):
    out = tmp_path / "race.json"
    command = [sys.executable, "benchmarks/gpu_race.py", "--device", "cpu", "--toy", "--modes", "bf16"]
    command += ["--steps", "2", "--warmup", "1", "--seq-len", "32", "--batch-size", "2", "--out", str(out)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["results"]) == ["bf16"] and report["setup"]["torchtitan"] != "unknown"
    bf16 = report["results"]["bf16"]
    for side in ("forge", "torchtitan"):
        run = bf16[side]
        assert run["parameters"] == bf16["expected_parameters"] > 0, side  # the same shape on both sides
        assert run["tokens_per_sec"] > 0 and 0 < run["mfu"] < 1 and run["peak_memory_gib"] > 0, run
        assert math.isfinite(run["first_loss"]) and math.isfinite(run["last_loss"]), run
        assert abs(run["first_loss"] - math.log(256)) < 1.5, run  # vocab 256: near-uniform predictions at first
    ratio = bf16["forge"]["tokens_per_sec"] / bf16["torchtitan"]["tokens_per_sec"]
    assert bf16["forge_over_torchtitan_tokens_per_sec"] == ratio
