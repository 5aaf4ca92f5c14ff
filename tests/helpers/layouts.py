"""Multi-process runs as a user starts them (`forge train --nproc-per-node N` of a tiny model) and their comparison with one process within the fp32 tolerances of tests/helpers/parity.py."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

from engine.checkpoint.dcp import latest_checkpoint, load_checkpoint
from engine.config import load_job_config
from engine.data.shards import read_manifest
from engine.model.transformer import Transformer
from tests.conftest import REPO
from tests.helpers.data_fixtures import all_tokens, corpus_texts, tokenized
from tests.helpers.parity import Parity, TrainingTolerance
from tests.helpers.torchrun import run_bounded

GLOBAL_BATCH = 4


TINY = [
    "--model.dim=32",
    "--model.n_layers=4",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.vocab_size=4096",
    "--train.seq_len=32",
    "--model.max_seq_len=32",
    "--metrics.log_interval=1",
    "--eval.interval=3",
    "--eval.steps=2",
    "--checkpoint.interval=3",
    "--scheduler.warmup_steps=2",
    "--scheduler.decay_steps=10",
    "--train.max_steps=6",
    "--optimizer.eps=1e-4",
    "--train.z_loss_weight=1e-3",
    '--data.datasets=[{name="plays", embedded="plays", weight=2.0}, {name="poems", embedded="poems", weight=1.0}]',
]


# z-loss: trained with, left out of the eval loss (the pipeline turns it off for its forward-only passes).
# A mixture of two sources: every layout must also report each source's loss (loss/plays, loss/poems) as one
# process does, reduced over the ranks that hold its rows (data parallel) or positions (context parallel), and
# taken from the last stage under pipelining.
# eps: Adam moves an entry with a near-zero gradient by about lr whatever the gradient's size, so a rounding-level
# difference in a rarely seen token's embedding or head row could move it by 1e-5; a larger eps keeps such updates
# small (an update's sensitivity to its gradient is at most lr/ε). TrainingTolerance.weights assumes updates linear
# in the gradient's relative deviation, which these rows break: on an Intel Xeon (AVX-512, AMX) with eps 1e-5 the
# tp layout's head rows of tokens never targeted moved 1.55e-6 from one process's (115% of the bound; 41% on an AMD
# EPYC), with 1e-4 2.8e-7 (21%). The bound itself does not cover that regime: a known limit of the weights check.
def child_env() -> dict[str, str]:
    """Read at each call, after conftest's session fixture has set FORGE_CACHE_DIR and WANDB_MODE."""
    return {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def forge(run_dir: Path, *extra: str, nproc: int = 1, batch_size: int | None = None) -> subprocess.CompletedProcess:
    """`forge train` of the tiny model; the per-device batch keeps the global batch at GLOBAL_BATCH when all
    `nproc` ranks are data parallel (give `batch_size` for other layouts)."""
    launch = [f"--nproc-per-node={nproc}"] if nproc > 1 else []
    batch = f"--train.batch_size={batch_size or GLOBAL_BATCH // nproc}"
    return run_bounded(
        [
            sys.executable,
            "-m",
            "forgecli.app",
            "train",
            "presets/debug.toml",
            "--run-dir",
            str(run_dir),
            *TINY,
            batch,
            *launch,
            *extra,
        ],
        timeout=240,
        cwd=REPO,
        env=child_env(),
    )


def records(run_dir: Path, key: str = "loss") -> dict[int, dict]:
    # Whole lines only: rank 0 may be writing the last one as the test reads.
    lines = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True) if line.endswith("\n")]
    return {r["step"]: r for r in map(json.loads, lines) if key in r}


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    model = Transformer(load_job_config(run_dir / "config.toml").model)
    load_checkpoint(latest_checkpoint(run_dir / "checkpoints")[1], model)
    return model.state_dict()


def tolerance(run_dir: Path) -> TrainingTolerance:
    """The fp32 tolerances of a run against one process of the same global batch (tests/helpers/parity.py derives
    them): the sizes from the run's config, the loss scale ln(vocab) (where an untrained model starts)."""
    cfg = load_job_config(run_dir / "config.toml")
    state = latest_checkpoint(run_dir / "checkpoints")[1] / "train_state.json"
    tokens = json.loads(state.read_text())["tokens_per_step"]
    params = sum(t.numel() for t in Transformer(cfg.model).state_dict().values())
    return TrainingTolerance.of(
        cfg.model, seq=cfg.train.seq_len, tokens=tokens, params=params, loss_scale=math.log(cfg.model.vocab_size)
    )


def assert_same_run(run_dir: Path, reference: Path, parity: Parity) -> None:
    """Every step's loss, per-source losses and gradient norm, the eval loss and the final weights of `run_dir`
    are those of `reference`, within the fp32 tolerances derived in tests/helpers/parity.TrainingTolerance."""
    ours, ref = records(run_dir), records(reference)
    expected, got = weights(reference), weights(run_dir)
    tol = tolerance(run_dir)
    assert sorted(ours) == sorted(ref) == list(range(1, 7)), ours.keys()
    for step, record in ours.items():
        parity.within(f"loss step {step}", abs(record["loss"] - ref[step]["loss"]), tol.loss_at(step))
        parity.within(
            f"grad norm step {step}", abs(record["grad_norm"] / ref[step]["grad_norm"] - 1), tol.norm_at(step)
        )
        assert_same_source_losses(record, ref[step], parity, tol.loss_at(step))
    evals = records(run_dir, "eval_loss")
    assert sorted(evals) == [3, 6], evals.keys()
    eval_gap = abs(evals[6]["eval_loss"] - records(reference, "eval_loss")[6]["eval_loss"])
    parity.within("eval loss", eval_gap, tol.loss_at(7))  # the weights after step 6
    assert sorted(got) == sorted(expected)
    worst = max((got[name] - expected[name]).abs().max().item() for name in expected)
    largest = max(t.abs().max().item() for t in expected.values())
    parity.within("weights", worst, tol.weights([ref[step]["lr"] for step in sorted(ref)], largest))


def assert_same_source_losses(record: dict, reference: dict, parity: Parity, tol: float) -> None:
    """A logged step's per-source losses (`loss/NAME`) are the reference step's: the same sources, each within tol."""
    per_source = sorted(k for k in reference if k.startswith("loss/"))
    assert per_source and sorted(k for k in record if k.startswith("loss/")) == per_source, record["step"]
    worst = max(abs(record[key] - reference[key]) for key in per_source)
    parity.within(f"per-source losses step {record['step']}", worst, tol)


# The pipeline's micro-batches are the step's grad_accum_steps: 2 of half the batch, the same global batch.
# Evaluation runs through the schedule too, 2 micro-batches a pass: 4 batches of 2 are the one-process run's
# 2 batches of 4 held-out sequences.
# gpipe and interleaved_1f1b take the loss from the logits (the plain cross-entropy); 1f1b keeps the preset's
# chunked one, which the last stage computes from its final hidden states through its head.
PIPELINE_LAYOUT = ["--distributed.pp=2", "--distributed.dp_shard=1", "--train.grad_accum_steps=2", "--eval.steps=4"]


PIPELINE = [*PIPELINE_LAYOUT, "--train.loss_fn=cross_entropy"]


CONTEXT_PARALLEL = ["--distributed.cp=2", "--distributed.dp_shard=1"]


MOE = [
    "--model.num_experts=4",
    "--model.moe_top_k=2",
    "--model.moe_router=sigmoid_topk",
    "--model.moe_shared_experts=1",
    "--model.moe_bias_schedule=[[0,0.01]]",
    "--model.moe_aux_loss_weight=0.001",
]


def assert_step_6_weights_and_resume(single: Path, piped: Path, args: list[str], parity, what: str) -> set[str]:
    """The pipelined run's step-6 weights are the one-process run's (within tests/helpers/parity.TrainingTolerance), and
    step 7 in one process from its step-6 checkpoint gives the uninterrupted run's loss. → the weights' names."""
    ref, tol = records(single), tolerance(single)
    expected, got = step_weights(single, 6), step_weights(piped, 6)
    assert sorted(got) == sorted(expected)
    largest = max(t.abs().max().item() for t in expected.values() if t.is_floating_point())
    bound = tol.weights([ref[step]["lr"] for step in range(1, 7)], largest)
    parity.close(got, expected, atol=bound, what=what)
    result = forge(piped, *args, "--train.max_steps=7", batch_size=2)
    assert result.returncode == 0, result.stderr[-3000:]
    parity.within("resumed step 7 loss", abs(records(piped)[7]["loss"] - ref[7]["loss"]), tol.loss_at(7))
    return set(got)


def step_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    model = Transformer(load_job_config(run_dir / "config.toml").model)
    load_checkpoint(run_dir / "checkpoints" / f"step_{step}", model)
    return model.state_dict()


def short_documents(tmp_path_factory) -> tuple[list[str], Path]:
    """Short documents (an end-of-document token in every 32 tokens: every window the loader can cut holds at
    least two documents) and one process's packed run on them, the reference of the packed layouts below;
    → (the data arguments, the packed run). Packing ran: the losses of that run (the layouts' within 1e-5 of
    it) are not those of the unpacked run on the same windows."""
    tmp = tmp_path_factory.mktemp("short")
    texts = [work[i : i + 24] for work in corpus_texts() for i in range(0, 2400, 100)]
    data = tokenized(tmp, texts)
    eos = read_manifest(data).eos_id
    ends = [i for i, token in enumerate(all_tokens(data).tolist()) if token == eos]
    assert len(ends) == len(texts) and max(b - a for a, b in itertools.pairwise([-1, *ends])) <= 32, "an EOS a window"
    source = [f'--data.datasets=[{{name="short", path="{data}", weight=1.0}}]', f"--eval.dataset_path={data}"]
    packed, plain = tmp / "packed", tmp / "plain"
    for run_dir, extra in ((packed, ["--data.pack_sequences=true"]), (plain, [])):
        result = forge(run_dir, *source, *extra)
        assert result.returncode == 0, result.stderr[-3000:]
    # Measured: 5e-5 apart at step 1 (the initial model's output hardly depends on the context), 1e-2 by step 6.
    ours, unpacked = records(packed), records(plain)
    assert sorted(unpacked) == list(range(1, 7))
    assert all(abs(ours[step]["loss"] - unpacked[step]["loss"]) > 1e-5 for step in range(1, 7))
    assert abs(records(packed, "eval_loss")[6]["eval_loss"] - records(plain, "eval_loss")[6]["eval_loss"]) > 1e-2
    return source, packed
