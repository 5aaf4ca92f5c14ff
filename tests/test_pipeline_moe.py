"""Pipeline parallelism with a mixture-of-experts model, as a user starts it (`forge train --nproc-per-node 2`,
gloo on CPU): pp = 2 (1F1B, selective checkpointing) against one process on the same micro-batches — per-step
losses, gradient norms, evaluation, every routing metric (the balancing bias of each layer, its load
imbalance, the auxiliary losses) step by step, and the final weights and router buffers within 1e-5 — and its
checkpoint resumes in one process with the uninterrupted run's next loss.

Both runs train with the batch-level balance loss, the router z-loss and the sigmoid router's balancing bias.
Each stage's routers' auxiliary losses reach the schedule's backward on the stage's output
(engine/parallel/pipeline_moe.py); without them the routers' gradients, and from step 2 the losses, differ.
The stages are told their shapes up front, so no placeholder forward moves the bias before step 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.checkpoint.dcp import load_checkpoint
from engine.config import load_job_config
from engine.errors import ConfigError
from engine.model.transformer import Transformer
from tests.test_distributed import MOE, PIPELINE, forge, records

pytestmark = pytest.mark.slow

# The one-process run takes the pipeline's micro-batches: 2 of 2 sequences a step (the auxiliary losses and the
# bias update are per micro-batch), and evaluates the same 4 held-out batches of 2.
MICRO = ["--train.grad_accum_steps=2", "--eval.steps=4", "--train.loss_fn=cross_entropy"]
MOE_PP = [*MOE, "--model.moe_router_z_loss_weight=0.001", *MICRO]


def test_moe_pipelined_matches_one_process_and_resumes_in_one(tmp_path):
    single, piped = tmp_path / "single", tmp_path / "pp2"
    result = forge(single, *MOE_PP, "--train.max_steps=7", batch_size=2)  # its step 7: what the resume must give
    assert result.returncode == 0, result.stderr[-3000:]
    pipeline = [*PIPELINE, "--distributed.pp_schedule=1f1b", "--train.activation_checkpointing=selective"]
    result = forge(piped, *MOE_PP, *pipeline, nproc=2, batch_size=2)
    assert result.returncode == 0, result.stderr[-3000:]
    ours, ref = records(piped), records(single)
    assert sorted(ours) == list(range(1, 7)), ours.keys()
    routing = sorted(key for key in ref[6] if key.startswith("moe/"))
    # 4 MoE layers × (imbalance, dropped, 3 aux losses, bias min/max) + the two totals, from both stages
    assert len(routing) == 4 * 7 + 2 and sorted(key for key in ours[6] if key.startswith("moe/")) == routing
    assert ref[6]["moe/0/bias_max"] > 0 and ref[6]["moe/3/balance_loss"] > 0
    for step in range(1, 7):
        assert ours[step]["loss"] == pytest.approx(ref[step]["loss"], abs=1e-5), step
        assert ours[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-3), step
        for key in routing:
            assert ours[step][key] == pytest.approx(ref[step][key], abs=1e-6), (step, key)
    evals, ref_evals = records(piped, "eval_loss"), records(single, "eval_loss")
    assert sorted(evals) == [3, 6] and evals[6]["eval_loss"] == pytest.approx(ref_evals[6]["eval_loss"], abs=1e-5)
    # The step-6 weights, every router's bias, pending load and update count included.
    expected = step_weights(single, 6)
    for name, value in step_weights(piped, 6).items():
        torch.testing.assert_close(value, expected[name], atol=1e-5, rtol=0, msg=name)
    # Step 7 in one process, from the pipelined run's step-6 checkpoint.
    result = forge(piped, *MOE_PP, "--train.max_steps=7", batch_size=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert records(piped)[7]["loss"] == pytest.approx(ref[7]["loss"], abs=1e-5)


def step_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    model = Transformer(load_job_config(run_dir / "config.toml").model)
    load_checkpoint(run_dir / "checkpoints" / f"step_{step}", model)
    return model.state_dict()


def test_full_checkpointing_with_a_balancing_bias_is_refused_in_a_pipeline():
    """A stage runs later micro-batches' forwards (moving the bias) before an earlier one's backward, whose
    full recomputation would route with the moved bias; selective checkpointing keeps the routing decisions."""
    args = [*MOE, *PIPELINE, "--train.activation_checkpointing=full"]
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing: .full. with distributed\.pp = 2"):
        load_job_config(None, args).validate(2)
    load_job_config(None, [*args, "--train.activation_checkpointing=selective"]).validate(2)
    softmax = [a for a in args if not a.startswith(("--model.moe_router=", "--model.moe_bias_schedule="))]
    load_job_config(None, [*softmax, "--model.moe_router=softmax_topk"]).validate(2)
