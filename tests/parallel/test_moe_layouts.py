"""MoE models in the layouts added for them, as a user starts them (`forge train --nproc-per-node N`, gloo on
CPU): tp = 2; tp = 2 × ep = 2 and ep = 2 under HSDP (2 replicas × dp_shard 2) on four processes; each against
one process on the same global batch — per-step losses, gradient norms, evaluation, the routers' balancing
bias step by step, and the final weights (buffers included) within 1e-5 — and their checkpoints resume in one
process with the uninterrupted run's next loss.

Without the batch-level balance loss, as in tests/parallel/test_expert_parallel.py's comparison with one process: every data-parallel
rank computes it over its own micro-batch (tp = 2 alone has one data-parallel rank and matches with it too;
checked by hand: every step within 1e-6). The router z-loss, a mean over tokens, stays on."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.layouts import MOE, assert_same_run, forge, records, tolerance

# One worker runs the module (`make test` passes --dist loadfile), so its one-process reference and resume are
# computed once, not on each worker.
pytestmark = pytest.mark.slow

MOE_TP = [*MOE, "--model.moe_aux_loss_weight=0", "--model.moe_router_z_loss_weight=0.001"]
LAYOUTS = {
    "tp2": (["--distributed.tp=2", "--distributed.dp_shard=1"], 2, 4),
    "tp2_ep2": (["--distributed.tp=2", "--distributed.ep=2"], 4, 2),  # dp_shard = 2 = ep: experts 2 per rank
    "ep2_hsdp": (["--distributed.dp_replicate=2", "--distributed.dp_shard=2", "--distributed.ep=2"], 4, 1),
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("moe_layouts") / "single"
    result = forge(run_dir, *MOE_TP)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def seventh_step(tmp_path_factory, one_process) -> float:
    """The one-process run's step 7, resumed from its own step-6 checkpoint."""
    run_dir = tmp_path_factory.mktemp("moe_layouts") / "single7"
    shutil.copytree(one_process, run_dir)
    result = forge(run_dir, *MOE_TP, "--train.max_steps=7")
    assert result.returncode == 0, result.stderr[-3000:]
    return records(run_dir)[7]["loss"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_layout_matches_one_process_and_resumes_in_one(tmp_path, one_process, seventh_step, layout, parity):
    args, nproc, batch_size = LAYOUTS[layout]
    run_dir = tmp_path / "run"
    result = forge(run_dir, *MOE_TP, *args, nproc=nproc, batch_size=batch_size)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(run_dir, one_process, parity)
    ours, ref = records(run_dir), records(one_process)
    bias_keys = sorted(key for key in ref[6] if key.endswith(("bias_max", "bias_min")))
    assert len(bias_keys) == 8 and ref[6]["moe/1/bias_max"] > 0  # four MoE layers' bias, which has moved
    # bias += rate · sign(mean load − load): the same loads give the same fp32 sums, bit for bit
    worst = max(abs(ours[step][key] - ref[step][key]) for step in range(1, 7) for key in bias_keys)
    parity.within("balancing biases, steps 1-6", worst, 0.0)
    # The same checkpoint, now in one process: the next step is the uninterrupted run's.
    result = forge(run_dir, *MOE_TP, "--train.max_steps=7", batch_size=4)
    assert result.returncode == 0, result.stderr[-3000:]
    parity.within("loss step 7", abs(records(run_dir)[7]["loss"] - seventh_step), tolerance(one_process).loss_at(7))
