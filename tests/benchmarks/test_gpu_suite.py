"""benchmarks/gpu_suite.sh at toy size on CPU (`--toy`): the one-GPU suite cannot rot between GPU sessions. Its
JSON must hold values the runs measured, checked against what the test knows independently: MFU against the
model's FLOPs per token and the CPU's peak, throughput against the time the item took, the memory estimate
against `estimate_memory` of the same overrides; the Markdown table shows the same numbers, and the FP8 rows
say they were not run, with no number."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine.config.loader import load_job_config
from engine.metrics.mfu import peak_flops
from engine.parallel.memory import estimate_memory
from tests.conftest import REPO

MEASURED = ("1b bf16 cross_entropy", "1b bf16 chunked_cross_entropy", "1b bf16 muon", "moe_small ep=1")


def test_the_gpu_suite_runs_at_toy_size_and_records_measured_values(tmp_path):
    out = tmp_path / "suite"
    command = ["bash", "benchmarks/gpu_suite.sh", "--toy", "--out", str(out), "--work", str(tmp_path / "runs")]
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out.parent / "suite.json").read_text())
    table = (out.parent / "suite.md").read_text()
    assert report["toy"] and report["in_process"] and report["machine"]["torch"] == torch.__version__
    assert len(report["machine"]["commit"]) >= 7
    assert len(report["train"]) == 8 and not list((tmp_path / "runs").glob("*/metrics.jsonl")), "run dirs removed"
    peak = peak_flops(torch.device("cpu"), torch.bfloat16)
    for name in MEASURED:
        row = report["train"][name]
        assert row["status"] == "measured", (name, row)
        assert row["tokens_per_step"] == 64 and row["window_steps"] == 2 and row["step"] == 4
        # the window's tokens took at most the whole item's time
        assert 0 < row["tokens_per_step"] * row["window_steps"] / row["tokens_per_sec"] < row["seconds"], row
        assert row["mfu"] == pytest.approx(row["flops_per_token"] * row["tokens_per_sec"] / peak, rel=1e-9)
        assert 7.5 < row["loss"] < 9.5, row  # ln 4096 = 8.3: an untrained toy model on real tokens
        argv = row["command"][row["command"].index("train") + 1 :]
        preset, overrides = argv[0], argv[1 : argv.index("--run-dir")]
        estimate = estimate_memory(load_job_config(REPO / preset, overrides), 1)[0].total / 2**30
        assert row["mem_estimate_gib"] == pytest.approx(estimate, rel=1e-12) and row["mem_peak_gib"] > 0
        assert row["estimate_over_peak"] == pytest.approx(estimate / row["mem_peak_gib"], rel=1e-12)
        assert f"| {name} | measured (step 4) | {row['tokens_per_sec']:,.0f} |" in table
    fp8 = [name for name in report["train"] if "fp8" in name]
    assert len(fp8) == 4 and all(report["train"][n]["status"] == "not run: toy mode (no FP8 on CPU)" for n in fp8)
    assert all(f"| {n} | not run: toy mode (no FP8 on CPU) | not measured |" in table for n in fp8)
    race = report["race"]
    assert race["status"] == "measured" and list(race["modes"]) == ["bf16"]
    bf16 = race["modes"]["bf16"]
    assert bf16["forge_tokens_per_sec"] > 0 and bf16["torchtitan_tokens_per_sec"] > 0
    assert bf16["forge_over_torchtitan"] == pytest.approx(
        bf16["forge_tokens_per_sec"] / bf16["torchtitan_tokens_per_sec"]
    )
    assert f"| bf16 | {bf16['forge_tokens_per_sec']:,.0f} | {bf16['torchtitan_tokens_per_sec']:,.0f} |" in table
