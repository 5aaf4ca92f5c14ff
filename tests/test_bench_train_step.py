"""benchmarks/bench_train_step.py at toy size, so the script behind benchmarks/results/train_step_cpu.md cannot rot,
and its proof of precision (the dtype every linear layer produced) is shown to hold on both models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_the_step_benchmark_runs_both_models_in_the_precision_asked_for(tmp_path: Path):
    out = tmp_path / "step.json"
    command = [sys.executable, "benchmarks/bench_train_step.py", "--dim", "64", "--n-layers", "1", "--n-heads", "4"]
    command += ["--n-kv-heads", "2", "--vocab-size", "512", "--batch-size", "2", "--seq-len", "32", "--rounds", "1"]
    command += ["--steps", "1", "--warmup", "1", "--dtype", "bf16", "--out", str(out)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["setup"]["linear_output_dtypes"] == {"forge": ["torch.bfloat16"], "transformers": ["torch.bfloat16"]}
    timed = ("forge", "transformers", "transformers_fused_adamw", "kernels_only")
    assert all(report[name]["median_step_sec"] > 0 for name in timed), report
    forge, theirs = report["forge"]["tokens_per_sec"], report["transformers"]["tokens_per_sec"]
    assert report["ratio_forge_over_transformers"] == forge / theirs
