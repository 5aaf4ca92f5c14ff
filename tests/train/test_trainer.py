"""The training loop through the engine API: accumulation, clipping, precision, compile, checkpointing."""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine.config import load_job_config
from engine.errors import DataError
from engine.train.trainer import train
from tests.helpers.parity import TrainingTolerance
from tests.helpers.trainer import ComputeDtypes, rounding_tolerance, run


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def test_grad_accumulation_equals_the_larger_batch(tmp_path):
    """4 sequences in one micro-batch or 2 × 2 accumulated: same samples, same mean loss, same gradients."""
    whole = run(tmp_path, "whole", "train.batch_size=4", "train.grad_accum_steps=1")
    split = run(tmp_path, "split", "train.batch_size=2", "train.grad_accum_steps=2")
    assert [r["step"] for r in whole] == [r["step"] for r in split] == [1, 2, 3, 4]
    for a, b in zip(whole, split):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_gradients_are_clipped_before_the_step(tmp_path, monkeypatch):
    seen: list[float] = []
    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        seen.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    records = run(tmp_path, "clip", "train.grad_clip_norm=0.05")
    assert all(r["grad_norm"] > 0.05 for r in records)  # the reported norm is the one before clipping
    assert all(n == pytest.approx(0.05, rel=1e-4) for n in seen)
    seen.clear()
    unclipped = run(tmp_path, "noclip", "train.grad_clip_norm=0")
    assert seen == pytest.approx([r["grad_norm"] for r in unclipped], rel=1e-4)


def test_full_activation_checkpointing_leaves_losses_unchanged(tmp_path, parity):
    """Recomputation runs the same kernels on the same inputs: bit for bit."""
    plain = losses(run(tmp_path, "plain"))
    checkpointed = losses(run(tmp_path, "ac", "train.activation_checkpointing=full"))
    assert len(plain) == len(checkpointed) > 0
    parity.close(torch.tensor(checkpointed), torch.tensor(plain), atol=0, what="losses")


@pytest.mark.slow
@pytest.mark.timeout(900)  # inductor's cache may be cold on a fresh machine
def test_compiled_blocks_match_eager(tmp_path, parity):
    """Inductor fuses and reorders the fp32 sums: tests/helpers/parity.TrainingTolerance, step by step."""
    from torch._dynamo.utils import counters

    plain = losses(run(tmp_path, "plain"))
    torch._dynamo.reset()  # compile afresh, and count only this run's graphs
    counters.clear()
    compiled = losses(run(tmp_path, "compiled", "train.compile_model=true"))
    # It ran compiled: the two blocks share one graph (engine.parallel.apply.apply_compile, fullgraph: no
    # graph breaks), with its backward built by AOTAutograd.
    assert (counters["stats"]["unique_graphs"], counters["aot_autograd"]["total"]) == (1, 1), dict(counters)
    assert len(compiled) == len(plain) == 4
    tol = TrainingTolerance.of_run(load_job_config(tmp_path / "plain" / "config.toml"))
    for step, (a, b) in enumerate(zip(compiled, plain), 1):
        parity.within(f"loss step {step}", abs(a - b), tol.loss_at(step))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_trains_close_to_fp32(tmp_path, precision):
    """The forward really autocasts (the logits come out in the reduced dtype, fp32 without), and the losses
    differ from fp32's, but only by rounding (`rounding_tolerance`: 4 steps of 4 × 64 tokens, logits of rms
    0.16-0.18, allows 1.0e-3 in bf16 and 1.3e-4 in fp16). Measured (torch 2.13, CPU), the largest per-step
    |reduced − fp32| is 1.1e-4 (bf16) and 3.1e-5 (fp16): 9 and 4 times under."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    full, reduced_dtypes = ComputeDtypes(), ComputeDtypes()
    logits = "train.loss_fn=cross_entropy"  # the hook reads the logits, which the chunked loss never makes
    plain = losses(run(tmp_path, "fp32", "train.mixed_precision=fp32", logits, callbacks=[full]))
    reduced = losses(run(tmp_path, precision, f"train.mixed_precision={precision}", logits, callbacks=[reduced_dtypes]))
    assert full.seen == {(None, torch.float32)} and reduced_dtypes.seen == {(dtype, dtype)}
    assert len(reduced) == len(plain) == 4 and all(math.isfinite(x) for x in reduced)
    tolerance = rounding_tolerance(dtype, full.logits_rms, tokens=4 * 64, steps=4)
    print(f"max |{precision} - fp32| = {max(abs(a - b) for a, b in zip(reduced, plain)):.2e}, allowed {tolerance:.2e}")
    assert reduced == pytest.approx(plain, abs=tolerance)
    assert reduced != plain


def test_profiler_writes_a_trace_of_the_window(tmp_path):
    run(tmp_path, "prof", "profiling.enable=true", "profiling.start_step=2", "profiling.end_step=3")
    trace = tmp_path / "prof" / "profile" / "trace_steps_2-3_rank0.json"
    assert trace.is_file() and "traceEvents" in trace.read_text()[:2000]


def test_checkpoint_of_a_checkpointed_model_loads_into_a_plain_one(tmp_path):
    from engine.checkpoint.dcp import load_checkpoint
    from engine.model.transformer import Transformer

    run(tmp_path, "ac", "train.activation_checkpointing=full", "checkpoint.keep_last_n=1", "checkpoint.interval=2")
    cfg = load_job_config(tmp_path / "ac" / "config.toml")
    assert sorted(p.name for p in (tmp_path / "ac" / "checkpoints").iterdir()) == ["latest", "step_4"]
    state = load_checkpoint(tmp_path / "ac" / "checkpoints" / "step_4", Transformer(cfg.model))
    assert state["step"] == 4 and state["tokens_seen"] == 4 * 4 * 64


def test_tokens_seen_counts_the_tokens_each_step_trained_on(tmp_path, monkeypatch):
    """tokens_seen is counted from the micro-batches trained on, not taken from the batch plan: a loader whose
    batches come short (4, 3, 2, 4 rows of 64 tokens where the plan says 4) is logged and checkpointed with
    the tokens it gave."""
    from engine.checkpoint.dcp import load_checkpoint
    from engine.data.loader import TrainData
    from engine.model.transformer import Transformer

    planned = TrainData.batches
    rows = [4, 3, 2, 4]

    def short_batches(self, start_step=0):
        for step, (inputs, labels, *sources) in enumerate(planned(self, start_step)):
            keep = rows[step % len(rows)]
            yield (inputs[:keep], labels[:keep], *(s[:keep] for s in sources))

    monkeypatch.setattr(TrainData, "batches", short_batches)
    records = run(tmp_path, "short", "train.grad_accum_steps=1", "checkpoint.interval=4")
    counted = [64 * sum(rows[:step]) for step in range(1, 5)]
    assert [r["tokens_seen"] for r in records] == counted and counted != [4 * 64 * s for s in range(1, 5)]
    cfg = load_job_config(tmp_path / "short" / "config.toml")
    state = load_checkpoint(tmp_path / "short" / "checkpoints" / "step_4", Transformer(cfg.model))
    assert state["step"] == 4 and state["tokens_seen"] == counted[-1]


def test_damaged_shard_bytes_are_a_data_error(tmp_path):
    from engine.data.loader import open_train_data
    from tests.helpers.data_fixtures import job_config, tokenized

    data = tokenized(tmp_path)
    shard = sorted(data.glob("*.npy"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-64:] = b"\xff" * 64  # same size, ids 65535 far outside the 400-token vocabulary
    shard.write_bytes(bytes(raw))
    batches = open_train_data(job_config(data, "train.batch_size=64")).batches()
    with pytest.raises(DataError, match="corrupt"):
        for _ in range(50):
            next(batches)


def test_iterating_data_leaves_the_global_rng_alone(tmp_path):
    """A resumed run restores the RNG; the data loader must not draw from it, or the streams would differ."""
    from engine.data.loader import open_train_data
    from tests.helpers.data_fixtures import job_config, tokenized

    batches = open_train_data(job_config(tokenized(tmp_path))).batches(start_step=3)
    state = torch.get_rng_state()
    next(batches)
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_stop_and_resume_in_process_equals_one_run(tmp_path, precision):
    """Train 3 steps, then continue to 6 with `forge resume` semantics: same losses as 6 steps at once,
    including fp16's loss-scaler state, the schedule and a profiler window spanning the resume."""
    from engine.train.run_dir import run_config

    common = (
        f"train.mixed_precision={precision}",
        "scheduler.decay_steps=4",
        "checkpoint.interval=3",
        "profiling.enable=true",
        "profiling.start_step=2",
        "profiling.end_step=5",
    )
    whole = losses(run(tmp_path, "whole", "train.max_steps=6", *common))
    run(tmp_path, "parts", "train.max_steps=3", *common)
    train(run_config(tmp_path / "parts", ["train.max_steps=6"]), tmp_path / "parts")
    lines = (tmp_path / "parts" / "metrics.jsonl").read_text().splitlines()
    assert [r["loss"] for r in map(json.loads, lines) if "loss" in r] == whole
    assert (tmp_path / "parts" / "profile" / "trace_steps_4-5_rank0.json").is_file()
