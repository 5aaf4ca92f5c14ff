"""Multi-token prediction under pipeline parallelism (engine/parallel/pipeline.py): the last stage keeps a copy of
the embedding for its prediction modules, receives the window's token ids as a keyword argument, and sends the
main and the modules' outputs as one tensor, which `StageCrossEntropy` splits.

In-process (float64): two stage models run one after the other give one process's training loss, recorded
per-depth losses and gradients, the two embedding copies' gradients summing to the one matrix's (as
`TiedWeight.sync` sums them between the ranks), tied or not, with either loss; evaluation runs the main
model alone. As a user starts it (`forge train --nproc-per-node N`, gloo): pp = 2 (1F1B, the preset's chunked
loss, untied embeddings) and pp = 2 × tp = 2 (GPipe, tied) against one process on the same micro-batches, every
step's loss, main and per-depth loss, gradient norm, the eval loss and the step-6 weights, and the pipelined run
resumes in one process. The memory estimate counts the last stage's
embedding copy and what its modules save (0.999 of the saved tensors' bytes, either loss)."""

from __future__ import annotations

import pytest
import torch

from engine.config.job import JobConfig
from engine.config.model import ModelConfig
from engine.config.train import TrainConfig
from engine.model import materialize
from engine.model.transformer import Transformer
from engine.parallel.memory import estimate_memory, last_stage_output_bytes
from engine.parallel.pipeline import send_predictions, stage_model, stage_union
from engine.plan import check_config
from engine.train.losses import StageCrossEntropy, build_loss
from tests.helpers.layouts import PIPELINE_LAYOUT, assert_step_6_weights_and_resume, forge, records, tolerance
from tests.helpers.memory import ACTIVATION_TOLERANCE

SHAPE = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=16)


def stage_run(model: Transformer, tokens, labels, stage_loss: StageCrossEntropy, chunked: bool):
    """(loss, the two stage models) of one training forward and backward through stage 0 then stage 1, as the
    schedule calls them: every stage gets the keyword arguments, the last one's hook joins its outputs."""
    first, last = stage_model(model, 0, 2), stage_model(model, 1, 2)
    last.register_forward_hook(send_predictions)
    if chunked:
        stage_loss.bind_head(last.output)
    stage_loss.bind_predictions(last)
    kwargs = {"mtp": True, "mtp_tokens": tokens, **({"return_hidden": True} if chunked else {})}
    hidden = first(tokens, **kwargs)
    output = last(hidden, **kwargs)
    assert output.shape[0] == (1 + model.cfg.mtp_depth) * tokens.shape[0]
    loss = stage_loss(output, labels)
    loss.backward()
    return loss, first, last


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("loss_fn", ["cross_entropy", "chunked_cross_entropy"])
def test_stages_give_one_process_loss_and_gradients(tied, loss_fn):
    """float64, the same operations on the same values in the same order except the embedding's gradient, the
    sum of the two copies' (two partial sums added, FP64 roundoff only): within 1e-12."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**SHAPE, mtp_depth=2, mtp_loss_weight=0.3, tie_embeddings=tied))
        tokens, labels = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
        chunked = loss_fn == "chunked_cross_entropy"
        # the stages first: they are copies of the model, which must not have gradients or losses yet
        loss, first, last = stage_run(model, tokens, labels, StageCrossEntropy(0.01, 7 if chunked else None), chunked)
        train = TrainConfig(loss_fn=loss_fn, ce_chunk_size=7, z_loss_weight=0.01)
        expected = build_loss(train)(model, tokens, labels)
        expected.backward()
        torch.testing.assert_close(loss, expected, atol=1e-12, rtol=0)
        window, count = last.mtp_loss_window
        assert count == 1 and window.shape == (3,)
        torch.testing.assert_close(window, model.mtp_loss_window[0], atol=1e-12, rtol=0)

        assert first.mtp is None and first.output is None and last.mtp is not None
        assert last.tok_embeddings is not None and (last.output.weight is last.tok_embeddings.weight) == tied
        # what the optimizer and checkpoints see on the last stage's rank: the modules and the embedding copy
        held = stage_union([last]).state_dict()
        assert {"mtp.1.proj.weight", "mtp.2.norm.weight", "tok_embeddings.weight", "output.weight"} <= held.keys()
        assert sorted(stage_union([first, last]).state_dict()) == sorted(model.state_dict())
        grads = {name: p.grad for name, p in first.named_parameters()}
        for name, p in last.named_parameters():  # the embedding's copy: its gradient summed with the first's
            grads[name] = grads[name] + p.grad if name in grads else p.grad
        reference = {name: p.grad for name, p in model.named_parameters()}
        assert sorted(grads) == sorted(reference) and "mtp.2.proj.weight" in grads
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference[name], atol=1e-12, rtol=0, msg=name)
        # Without the last stage's share the embedding's gradient is not one process's: the copy is needed.
        only_first = next(p.grad for name, p in first.named_parameters() if name == "tok_embeddings.weight")
        assert (only_first - reference["tok_embeddings.weight"]).abs().max() > 1e-4
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_tied_last_stage_materialized_from_meta_keeps_one_matrix():
    """The last stage with tied embeddings holds the embedding and the head as one parameter; `to_empty` gives
    each module its own tensor, and the job's materialization shares them again (pp without FSDP or TP keeps
    plain parameters). Without it the head and the lookup train two matrices (measured through the CLI,
    interleaved 1F1B: losses 0.06 apart from one process's by step 6)."""
    with torch.device("meta"):
        model = Transformer(ModelConfig(**SHAPE, mtp_depth=1, tie_embeddings=True))
    last = stage_model(model, 1, 2)
    last.to_empty(device="cpu")
    assert last.output.weight is not last.tok_embeddings.weight  # what to_empty does to shared plain tensors
    last = stage_model(model, 1, 2)
    materialize(last, torch.device("cpu"))
    assert last.output.weight is last.tok_embeddings.weight
    assert last.rope_cos.device.type == "cpu" and torch.isfinite(last.rope_cos).all()


def test_evaluation_runs_the_main_model_alone():
    """Evaluation passes the stages no token ids (Pipeline.stage_kwargs): the last stage sends the main output
    alone, and the loss's plain mode gives the model's plain cross-entropy, exactly."""
    torch.manual_seed(1)
    model = Transformer(ModelConfig(**SHAPE, mtp_depth=1))
    tokens, labels = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    stage_loss = StageCrossEntropy(0.1)
    first, last = stage_model(model, 0, 2), stage_model(model, 1, 2)
    last.register_forward_hook(send_predictions)
    stage_loss.bind_predictions(last)
    with torch.no_grad(), stage_loss.plain():
        output = last(first(tokens))
        assert output.shape == (2, 16, 97)
        value = stage_loss(output, labels)
        expected = build_loss(TrainConfig(loss_fn="cross_entropy", z_loss_weight=0.1))(
            model, tokens, labels, z_loss=False
        )
    assert value.item() == expected.item()
    assert not hasattr(last, "mtp_loss_window")  # evaluation reports no depth losses


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "chunked_cross_entropy"])
def test_memory_estimate_of_the_last_stage_counts_the_modules_and_the_embedding_copy(loss_fn):
    """Each pipeline rank's parameter bytes are its stage model's: with untied embeddings the last stage holds
    the prediction modules and a copy of the embedding besides its head. The last stage's activations are
    what one micro-batch through it and its loss saves (measured with saved-tensor hooks, within the
    estimate's 5%, with CPU RMSNorm's extra copies as in tests/parallel/test_memory_estimate.py)."""
    model_cfg = {**SHAPE, "mtp_depth": 2, "tie_embeddings": False, "sdpa_backend": "flash"}
    train = {"batch_size": 2, "seq_len": 16, "grad_accum_steps": 2, "loss_fn": loss_fn, "z_loss_weight": 0}
    train["mixed_precision"] = "fp32"  # the measurement runs without autocast
    chunk = {"ce_chunk_size": 8} if loss_fn == "chunked_cross_entropy" else {}
    cfg = check_config(JobConfig(model=model_cfg, train={**train, **chunk}, distributed={"pp": 2}), 2)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    rows = estimate_memory(cfg, 2)
    assert len(rows) == 2
    for stage, row in enumerate(rows):
        part = stage_model(model, stage, 2)
        assert row.params == sum(p.nbytes for p in part.parameters()), stage
    embedding = cfg.model.vocab_size * cfg.model.dim * 4
    assert rows[1].params - rows[0].params > embedding  # the copy, the head and the modules

    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
    chunked = loss_fn == "chunked_cross_entropy"
    first, last = stage_model(model, 0, 2), stage_model(model, 1, 2)
    last.register_forward_hook(send_predictions)
    stage_loss = StageCrossEntropy(0.0, 8 if chunked else None)
    stage_loss.bind_predictions(last)
    if chunked:
        stage_loss.bind_head(last.output)
    kwargs = {"mtp": True, "mtp_tokens": tokens, **({"return_hidden": True} if chunked else {})}
    hidden = first(tokens, **kwargs).detach().requires_grad_()  # as the last stage receives it
    state = {t.untyped_storage().data_ptr() for t in [*last.parameters(), *last.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in state:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = last(hidden, **kwargs)
        stage_loss(output, tokens)
    n = tokens.numel()
    cpu_rmsnorm_extra = cfg.model.dim * 4 * n * ((2 + 1) + cfg.model.mtp_depth * 5)  # its block, final, modules
    estimate = rows[1].activations // rows[1].microbatches_in_flight + cpu_rmsnorm_extra
    assert abs(estimate / sum(seen.values()) - 1) < ACTIVATION_TOLERANCE, (estimate, sum(seen.values()))
    # Beyond what autograd saves: the output the schedule keeps until backward, and its gradient (the split's).
    assert output.shape[0] == 3 * 2 and last_stage_output_bytes(cfg, n, [1], 2) == 2 * output.nbytes
    assert last_stage_output_bytes(cfg, n, [0, 0], 2) == 0  # (micro-batches in flight on the first stage only)


MTP_PP = ["--model.mtp_depth=2", "--model.mtp_loss_weight=0.5", "--train.grad_accum_steps=2", "--eval.steps=4"]
# (the one-process run's arguments besides MTP_PP, the pipeline's besides those, processes): the untied embedding's
# copy under 1F1B with the preset's chunked loss; the tied matrix under pp × tp (GPipe, the plain loss: the chunked
# one is refused with pp × tp), where the first stage's lookup gradient comes out replicated and the head's sharded
# (TiedWeight.sync lays them out alike; before, tied embeddings crashed there with or without the modules).
LAYOUTS = {
    "untied_1f1b_chunked": (["--model.tie_embeddings=false"], ["--distributed.pp_schedule=1f1b"], 2),
    "tied_tp2_gpipe": (
        ["--model.tie_embeddings=true", "--train.loss_fn=cross_entropy"],
        ["--distributed.tp=2", "--distributed.pp_schedule=gpipe"],
        4,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipelined_multi_token_prediction_matches_one_process_and_resumes_in_one(tmp_path, layout, parity):
    model, pipeline, nproc = LAYOUTS[layout]
    single, piped, args = tmp_path / "single", tmp_path / "pp2", [*MTP_PP, *model]
    result = forge(single, *args, "--train.max_steps=7", batch_size=2)  # its step 7: what the resume must give
    assert result.returncode == 0, result.stderr[-3000:]
    result = forge(piped, *args, *PIPELINE_LAYOUT, *pipeline, nproc=nproc, batch_size=2)
    assert result.returncode == 0, result.stderr[-3000:]
    ours, ref = records(piped), records(single)
    assert sorted(ours) == list(range(1, 7)), ours.keys()
    tol = tolerance(single)
    for step in range(1, 7):
        for key in ("loss", "loss_main", "mtp/loss_1", "mtp/loss_2"):
            parity.within(f"{key} step {step}", abs(ours[step][key] - ref[step][key]), tol.loss_at(step))
        gap = abs(ours[step]["grad_norm"] / ref[step]["grad_norm"] - 1)
        parity.within(f"grad norm step {step}", gap, tol.norm_at(step))
    assert ours[6]["mtp/loss_2"] != ours[6]["mtp/loss_1"] != ours[6]["loss_main"]
    evals, ref_evals = records(piped, "eval_loss"), records(single, "eval_loss")
    assert sorted(evals) == [3, 6]
    parity.within("eval loss", abs(evals[6]["eval_loss"] - ref_evals[6]["eval_loss"]), tol.loss_at(7))
    # The step-6 weights: the prediction modules, and the embedding both stages trained (one checkpoint entry).
    names = assert_step_6_weights_and_resume(single, piped, args, parity, "step-6 weights")
    assert {"mtp.2.block.attention.wq.weight", "tok_embeddings.weight", "output.weight"} <= names
