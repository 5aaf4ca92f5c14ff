"""Pipeline parallelism with a mixture-of-experts model, as a user starts it (`forge train --nproc-per-node 2`,
gloo on CPU): pp = 2 (1F1B, selective checkpointing) against one process on the same micro-batches — per-step
losses, gradient norms, evaluation, every routing metric (the balancing bias of each layer, its load
imbalance, the auxiliary losses) step by step, and the step-6 weights and router buffers within the fp32
tolerances of tests/helpers/parity.TrainingTolerance (fp32: grouped_mm has no float64 kernel) — and its checkpoint
resumes in one process with the uninterrupted run's next loss (measured: every loss within 1e-6; without
carrying the auxiliary losses, 9e-4 apart by step 6). Also in-process: stage models carrying their
auxiliary losses give one process's gradients; the memory estimate of each stage is its stage model's; full
activation checkpointing with a balancing bias is refused in a pipeline.

Both runs train with the batch-level balance loss, the router z-loss and the sigmoid router's balancing bias,
routing group-limited.
Each stage's routers' auxiliary losses reach the schedule's backward on the stage's output
(engine/parallel/pipeline_moe.py); without them the routers' gradients, and from step 2 the losses, differ.
The stages are told their shapes up front, so no placeholder forward moves the bias before step 1.

Mixtral's router (softmax, top-k weights renormalised) has a lighter launch of its own, 3 steps: pp = 2 with
interleaved 1F1B and FSDP (dp_shard = 2), each against one process on the same micro-batches."""

from __future__ import annotations

import pytest
import torch

from engine.config import load_job_config
from engine.config.job import JobConfig
from engine.config.model import ModelConfig
from engine.errors import ConfigError
from engine.model.transformer import Transformer
from engine.parallel.memory import estimate_memory
from engine.parallel.pipeline import stage_model
from engine.parallel.pipeline_moe import StageAuxLosses
from engine.plan import check_config
from engine.train.losses import cross_entropy
from tests.helpers.layouts import (
    MOE,
    PIPELINE,
    assert_step_6_weights_and_resume,
    forge,
    records,
    step_weights,
    tolerance,
)
from tests.helpers.memory import ACTIVATION_TOLERANCE, is_weight_copy
from tests.helpers.parity import model_bound

# The one-process run takes the pipeline's micro-batches: 2 of 2 sequences a step (the auxiliary losses and the
# bias update are per micro-batch), and evaluates the same 4 held-out batches of 2.
MICRO = ["--train.grad_accum_steps=2", "--eval.steps=4", "--train.loss_fn=cross_entropy"]
# The sigmoid router routes group-limited (DeepSeek-V3: 2 groups of 2 experts, a token keeps the better one).
GROUPED = ["--model.moe_n_group=2", "--model.moe_topk_group=1"]
MOE_PP = [*MOE, *GROUPED, "--model.moe_router_z_loss_weight=0.001", *MICRO]


@pytest.mark.slow
def test_moe_pipelined_matches_one_process_and_resumes_in_one(tmp_path, parity):
    single, piped = tmp_path / "single", tmp_path / "pp2"
    result = forge(single, *MOE_PP, "--train.max_steps=7", batch_size=2)  # its step 7: what the resume must give
    assert result.returncode == 0, result.stderr[-3000:]
    pipeline = [*PIPELINE, "--distributed.pp_schedule=1f1b", "--train.activation_checkpointing=selective"]
    result = forge(piped, *MOE_PP, *pipeline, nproc=2, batch_size=2)
    assert result.returncode == 0, result.stderr[-3000:]
    ours, ref = records(piped), records(single)
    assert sorted(ours) == list(range(1, 7)), ours.keys()
    routing = sorted(key for key in ref[6] if key.startswith("moe/"))
    # 4 MoE layers × (imbalance, load_cv, dead_experts, dropped, 3 aux losses, bias min/max) + the five totals
    # (imbalance and its layer, load_cv, dropped, dead experts), from both stages
    assert len(routing) == 4 * 9 + 5 and sorted(key for key in ours[6] if key.startswith("moe/")) == routing
    # the biases moved (by steps of 0.01, which can bring a layer's back to 0 by step 6)
    assert max(ref[6][f"moe/{layer}/bias_max"] for layer in range(4)) > 0 and ref[6]["moe/3/balance_loss"] > 0
    tol = tolerance(single)
    for step in range(1, 7):
        parity.within(f"loss step {step}", abs(ours[step]["loss"] - ref[step]["loss"]), tol.loss_at(step))
        gap = abs(ours[step]["grad_norm"] / ref[step]["grad_norm"] - 1)
        parity.within(f"grad norm step {step}", gap, tol.norm_at(step))
        # losses (aux losses of at most the loss's size), imbalances and biases: a routing decision that
        # differed would move them by a whole token's share or a bias step (0.01), far above the tolerance
        worst = max(abs(ours[step][key] - ref[step][key]) for key in routing)
        parity.within(f"routing metrics step {step}", worst, tol.loss_at(step))
    evals, ref_evals = records(piped, "eval_loss"), records(single, "eval_loss")
    assert sorted(evals) == [3, 6]
    parity.within("eval loss", abs(evals[6]["eval_loss"] - ref_evals[6]["eval_loss"]), tol.loss_at(7))
    # The step-6 weights, every router's bias, pending load and update count included.
    assert_step_6_weights_and_resume(single, piped, MOE_PP, parity, "step-6 weights and router buffers")


# Mixtral's router (softmax, the top-k weights renormalised) with the batch-level balance loss and the router
# z-loss; no shared experts and no balancing bias (Mixtral has neither). 3 steps of 2 micro-batches of 2.
MIXTRAL = [
    "--model.num_experts=4",
    "--model.moe_top_k=2",
    "--model.moe_router=softmax_topk_renorm",
    "--model.moe_aux_loss_weight=0.01",
    "--model.moe_router_z_loss_weight=0.001",
    "--train.max_steps=3",
    "--train.loss_fn=cross_entropy",
]
MIXTRAL_LAYOUTS = {
    # two stages a rank: the auxiliary losses ride on four stage outputs
    "pp2_interleaved": [*PIPELINE, "--distributed.pp_schedule=interleaved_1f1b"],
    # FSDP over 2 ranks, a micro-batch each: rank r's 2 sequences are the one process's micro-batch r
    # (engine/data/sampler.BatchLayout), so each balance loss is over the same tokens; eval: 2 batches of 2 a
    # rank are the one process's 4
    "fsdp2": ["--distributed.dp_shard=2", "--train.grad_accum_steps=1", "--eval.steps=2"],
}


@pytest.mark.slow
def test_mixtral_router_pipelined_and_sharded_matches_one_process(tmp_path, parity):
    """Mixtral's renormalising router under pp = 2 (interleaved 1F1B) and under FSDP (dp_shard = 2), each
    against one process on the same micro-batches, 3 steps: losses, gradient norms, the eval loss and the
    step-3 weights within the fp32 tolerances of tests/helpers/parity.TrainingTolerance, as above; under pp also every
    routing metric (each layer's balance and z-losses from whichever stage holds it, the last micro-batch's,
    as one process logs; under FSDP rank 0 logs its own micro-batch's routing, the one process's first).
    Checked by breaking it: the weights left unrenormalised on 2 ranks move the step-1 loss by 2e-4 (tolerance
    1.7e-5) under either layout; stages that drop their auxiliary losses' gradient (still logging them) move
    the step-2 routing by a token (imbalance 1/32 apart; the loss only 1e-5, within its 3.5e-5)."""
    single = tmp_path / "single"
    result = forge(single, *MIXTRAL, *MICRO, batch_size=2)
    assert result.returncode == 0, result.stderr[-3000:]
    ref, ref_evals = records(single), records(single, "eval_loss")
    routing = sorted(key for key in ref[3] if key.startswith("moe/"))
    # 4 MoE layers × (imbalance, load_cv, dead_experts, dropped, 3 aux losses) + the five totals
    assert len(routing) == 4 * 7 + 5 and min(ref[3][f"moe/{layer}/balance_loss"] for layer in range(4)) > 0
    tol, expected = tolerance(single), step_weights(single, 3)
    largest = max(t.abs().max().item() for t in expected.values() if t.is_floating_point())
    for layout, args in MIXTRAL_LAYOUTS.items():
        run_dir = tmp_path / layout
        result = forge(run_dir, *MIXTRAL, *args, nproc=2, batch_size=2)
        assert result.returncode == 0, result.stderr[-3000:]
        assert load_job_config(run_dir / "config.toml").model.moe_router == "softmax_topk_renorm"
        ours = records(run_dir)
        assert sorted(ours) == sorted(ref) == [1, 2, 3], (layout, ours.keys())
        assert sorted(key for key in ours[3] if key.startswith("moe/")) == routing, layout
        for step in range(1, 4):
            gap = abs(ours[step]["loss"] - ref[step]["loss"])
            parity.within(f"{layout} loss step {step}", gap, tol.loss_at(step))
            gap = abs(ours[step]["grad_norm"] / ref[step]["grad_norm"] - 1)
            parity.within(f"{layout} grad norm step {step}", gap, tol.norm_at(step))
            if layout.startswith("pp"):  # a data-parallel rank 0 logs the routing of its own micro-batch
                worst = max(abs(ours[step][key] - ref[step][key]) for key in routing)
                parity.within(f"{layout} routing metrics step {step}", worst, tol.loss_at(step))
        evals = records(run_dir, "eval_loss")
        assert sorted(evals) == sorted(ref_evals) == [3], layout
        parity.within(f"{layout} eval loss", abs(evals[3]["eval_loss"] - ref_evals[3]["eval_loss"]), tol.loss_at(4))
        got = step_weights(run_dir, 3)
        assert sorted(got) == sorted(expected), layout
        bound = tol.weights([ref[step]["lr"] for step in range(1, 4)], largest)
        parity.close(got, expected, atol=bound, what=f"{layout} step-3 weights")


def test_full_checkpointing_with_a_balancing_bias_is_refused_in_a_pipeline():
    """A stage runs later micro-batches' forwards (moving the bias) before an earlier one's backward, whose
    full recomputation would route with the moved bias; selective checkpointing keeps the routing decisions."""
    args = [*MOE, *PIPELINE, "--train.activation_checkpointing=full"]
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing: .full. with distributed\.pp = 2"):
        check_config(load_job_config(None, args), 2)
    check_config(load_job_config(None, [*args, "--train.activation_checkpointing=selective"]), 2)
    softmax = [a for a in args if not a.startswith(("--model.moe_router=", "--model.moe_bias_schedule="))]
    check_config(load_job_config(None, [*softmax, "--model.moe_router=softmax_topk"]), 2)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_memory_estimate_of_each_stage_is_what_its_moe_stage_holds(precision):
    """pp = 2 (1F1B) of a two-block MoE model, one block a stage: each pipeline rank's parameters are those
    of its stage model, and its activations are its micro-batches in flight times what one micro-batch
    through the stage saves (measured with saved-tensor hooks; the tolerance and the CPU RMSNorm's extra
    copy as in tests/parallel/test_memory_estimate.py)."""
    model_cfg = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128, "max_seq_len": 32}
    train = {"batch_size": 2, "seq_len": 32, "mixed_precision": precision, "grad_accum_steps": 2, "z_loss_weight": 0}
    cfg = check_config(
        JobConfig(
            model={**model_cfg, "sdpa_backend": "flash", "num_experts": 4, "moe_top_k": 2, "moe_shared_experts": 1},
            train={**train, "loss_fn": "cross_entropy"},
            distributed={"pp": 2},
        ),
        2,
    )
    rows = estimate_memory(cfg, 2)
    assert [row.microbatches_in_flight for row in rows] == [2, 1]  # 1F1B's warm-up depth
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32))
    h = tokens
    for stage, row in enumerate(rows):
        part = stage_model(model, stage, 2)
        assert row.params == sum(p.nbytes for p in part.parameters())
        h, saved = saved_bytes(part, h, tokens if stage == 1 else None, precision == "bf16")
        cpu_rmsnorm_extra = (2 + stage) * 4 * cfg.model.dim * tokens.numel()  # 2 per block, the final norm
        estimate = row.activations // row.microbatches_in_flight + cpu_rmsnorm_extra
        assert abs(estimate / saved - 1) < ACTIVATION_TOLERANCE, (stage, estimate, saved)


def saved_bytes(part: Transformer, inputs: torch.Tensor, labels: torch.Tensor | None, bf16: bool):
    """(output, bytes of the distinct activations autograd saves) of one micro-batch through a stage model, and
    through the loss on the last stage."""
    state = {t.untyped_storage().data_ptr() for t in [*part.parameters(), *part.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in state and not is_weight_copy(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = inputs.detach().requires_grad_(inputs.is_floating_point())  # as the stage receives it
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", torch.bfloat16, enabled=bf16),
    ):
        out = part(x)
        if labels is not None:
            cross_entropy(out, labels)
    return out, sum(seen.values())


def test_stages_carrying_their_aux_losses_give_one_process_gradients(parity):
    """Two stage models of an MoE model, run one after the other with `StageAuxLosses` attached, backward
    from the last stage's cross-entropy only: the gradients and the logged loss are those of the whole
    model's cross-entropy + auxiliary losses (without carrying, the first stage's routers get none of theirs).
    fp32 (grouped_mm has no float64 kernel): within parity.model_bound at each gradient's own scale."""
    cfg = ModelConfig(
        dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16, num_experts=4, moe_top_k=2,
        moe_aux_loss_weight=0.01, moe_sequence_aux_loss_weight=0.01, moe_router_z_loss_weight=0.01,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, 64, (2, 16))
    parts, carried = [stage_model(model, stage, 2) for stage in (0, 1)], StageAuxLosses()
    one_process = cross_entropy(model(tokens), tokens) + model.moe_loss()
    one_process.backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    for part in parts:
        carried.attach(part)
    cross_entropy(parts[1](parts[0](tokens)), tokens).backward()
    grads = {name: p.grad for part in parts for name, p in part.named_parameters()}
    assert sorted(grads) == sorted(expected) and grads["layers.0.feed_forward.router.gate.weight"] is not None
    for name, grad in grads.items():
        bound = model_bound(cfg, expected[name].abs().max().item(), backward=True)
        parity.close(grad, expected[name], atol=bound, what=f"gradient {name}")
    aux = carried.mean(1, tokens.device)
    assert aux > 0 and carried.values == []
    loss = cross_entropy(model(tokens), tokens) + aux
    parity.close(loss, one_process.detach(), atol=model_bound(cfg, one_process.item()), what="loss")
