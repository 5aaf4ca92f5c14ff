"""Training length the way recipes state it: a global batch and its ramp, epochs, tokens, a schedule in tokens,
the whole held-out set. The plan and the rules are checked against their definitions written out here; the
training runs are toy-sized."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from itertools import islice

import pytest
import torch

from engine.config import load_job_config
from engine.data.batch_plan import BatchPlan, Ramp, batch_plan
from engine.data.loader import TokenWindows, open_train_data
from engine.data.mixture import Phase, SourceDraws
from engine.data.sampler import BatchLayout, EpochOrder, EvalBatchSampler, MixtureBatchSampler
from engine.errors import ConfigError
from engine.plan import check_config
from engine.plan.length import with_derived_length
from engine.runs import summarize_run
from engine.train.schedules import learning_rate
from engine.train.step import weighted_mean
from engine.train.trainer import train
from tests.conftest import REPO
from tests.helpers.data_fixtures import job_config, tokenized

TINY = [
    "model.dim=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "train.seq_len=32",
    "model.max_seq_len=32",
    "metrics.log_interval=1",
    "eval.enabled=false",
    "scheduler.warmup_steps=1",
]


def ramp_by_definition(start: int, increment: int, full: int, length: int, in_tokens: bool, seq_len: int, steps: int):
    """Each step's sequences, step by step from the definition: B0 + I · min(k, floor(k · x / L)), x = steps done
    or tokens trained on before the step."""
    rises, seen, sizes = (full - start) // increment, 0, []
    for step in range(steps):
        position = seen * seq_len if in_tokens else step
        sizes.append(start + increment * min(rises, rises * position // length))
        seen += sizes[-1]
    return sizes


@pytest.mark.parametrize(
    ("start", "increment", "full", "length", "in_tokens"),
    [(4, 4, 16, 3, False), (8, 4, 32, 10, False), (8, 8, 64, 7, False), (4, 4, 32, 5000, True), (8, 8, 24, 100, True)],
)
def test_the_plan_is_the_ramp_definition_step_by_step(start, increment, full, length, in_tokens):
    plan = BatchPlan(4, full, 32, Ramp(start, increment, length, in_tokens))
    sizes = ramp_by_definition(start, increment, full, length, in_tokens, 32, 60)
    assert len(sizes) == 60 and sizes[-1] == full and sizes[0] == start
    assert [plan.sequences(s) for s in range(60)] == sizes
    assert [plan.samples_before(s) for s in range(60)] == [sum(sizes[:s]) for s in range(60)]
    assert [plan.micro_batches(s) for s in range(60)] == [n // 4 for n in sizes]
    for tokens in (1, 32, 1000, sum(sizes[:17]) * 32, sum(sizes[:17]) * 32 + 1):
        steps = plan.steps_for_tokens(tokens)
        assert plan.tokens_before(steps) >= tokens and (steps == 0 or plan.tokens_before(steps - 1) < tokens)


def test_a_ramp_reads_the_stream_in_order_and_the_same_for_every_layout(tmp_path):
    """The samples of each step are the stream's next G_s, whatever dp and accumulation split them."""
    data = tokenized(tmp_path)
    ramp = ("train.global_batch_size=16", "train.batch_ramp_start=4", "train.batch_ramp_steps=3")

    def global_batches(dp: int, batch_size: int) -> list[torch.Tensor]:
        cfg = job_config(data, *ramp, f"train.batch_size={batch_size}")
        plan = batch_plan(cfg, dp=dp)
        ranks = [iter(open_train_data(cfg, dp_rank=r, dp_size=dp).batches()) for r in range(dp)]
        steps = []
        for step in range(5):
            micro = [[next(rank)[0] for rank in ranks] for _ in range(plan.micro_batches(step))]
            steps.append(torch.cat([x for per_rank in micro for x in per_rank]))
        return steps

    one, two = global_batches(1, 4), global_batches(2, 2)
    assert [len(b) for b in one] == [4, 8, 12, 16, 16]
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    plain = job_config(data, "train.batch_size=4")  # the same stream, read 4 sequences at a time
    stream = torch.cat([x for x, _ in islice(open_train_data(plain).batches(), 14)])
    assert torch.equal(torch.cat(one), stream)


def test_a_mixture_under_a_ramp_draws_the_same_global_batches_for_every_layout():
    """Each step draws its own G_s sources (8, 16, 24, then 32): the same samples whether one rank reads them in
    micro-batches of 8 or two ranks in micro-batches of 4, and each step holds G_s of them."""
    phases = [Phase(0, (0.5, 0.3, 0.2), 1.0)]
    sizes, offsets = [50, 30, 7], [0, 50, 80]  # the third source runs out and starts a new epoch

    def global_batches(batch: int, dp: int) -> list[list[int]]:
        plan = BatchPlan(batch * dp, 32, 16, Ramp(8, 8, 3, False))
        out: dict[int, dict[int, int]] = {}
        for rank in range(dp):
            layout = BatchLayout(batch, 32 // (batch * dp), dp, rank, plan)
            draws = SourceDraws(phases, layout.step_sequences, seed=3)
            orders = [EpochOrder(n, (3, i)) for i, n in enumerate(sizes)]
            sampler = iter(MixtureBatchSampler(draws, orders, offsets, layout))
            for step in range(6):
                for micro in range(layout.micro_steps(step)):
                    first = layout.micro_batch_start(step, micro) - layout.step_start(step)
                    out.setdefault(step, {}).update(dict(enumerate(next(sampler), start=first)))
        return [[out[s][p] for p in sorted(out[s])] for s in range(6)]

    one = global_batches(8, 1)
    assert [len(b) for b in one] == [8, 16, 24, 32, 32, 32]
    assert global_batches(4, 2) == one


def test_the_lr_schedule_in_tokens_is_its_closed_form_at_every_step_of_a_ramp():
    """Cosine with warmup, both in tokens, read at the tokens trained on before each step (summed here from the
    ramp's definition): warmup (x + 1) / (W + 1), then m + (1 - m)(1 + cos(π p)) / 2 with p = (x - W) / D and D
    ending the decay on the last step, in float64 by a formula written out here."""
    overrides = [
        *TINY,
        "train.batch_size=4",
        "train.global_batch_size=32",
        "train.batch_ramp_start=8",
        "train.batch_ramp_increment=8",
        "train.batch_ramp_tokens=6000",
        "train.max_tokens=40000",
        "scheduler.unit=tokens",
        "scheduler.warmup_steps=2000",
        "scheduler.min_lr_ratio=0.1",
        "optimizer.lr=0.001",
    ]
    cfg = with_derived_length(check_config(load_job_config(REPO / "presets" / "debug.toml", overrides), 1), 1)
    sizes = ramp_by_definition(8, 8, 32, 6000, True, 32, 200)
    before = [sum(sizes[:s]) * 32 for s in range(200)]
    steps = next(s for s in range(200) if before[s] >= 40000)
    assert cfg.train.max_steps == steps and sorted(set(sizes[:steps])) == [8, 16, 24, 32]  # every level runs
    warmup, floor = 2000, 0.1
    decay = before[steps - 1] - warmup
    for step in range(steps):
        x = before[step]
        if x < warmup:
            expected = (x + 1) / (warmup + 1)
        else:
            expected = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min((x - warmup) / decay, 1.0)))
        assert learning_rate(cfg, step) == pytest.approx(0.001 * expected, rel=1e-12, abs=0), step
    assert learning_rate(cfg, steps - 1) == pytest.approx(0.001 * floor, rel=1e-12)


def test_a_schedule_in_steps_is_unchanged_by_the_ramp():
    plain = check_config(load_job_config(REPO / "presets" / "debug.toml", ["train.max_steps=50"]), 1)
    ramp = check_config(
        load_job_config(
            REPO / "presets" / "debug.toml",
            [
                "train.max_steps=50",
                "train.global_batch_size=32",
                "train.batch_ramp_start=8",
                "train.batch_ramp_steps=10",
            ],
        ),
        1,
    )
    assert [learning_rate(with_derived_length(ramp, 1), s) for s in range(50)] == [
        learning_rate(with_derived_length(plain, 1), s) for s in range(50)
    ]


def test_the_whole_held_out_set_is_shared_out_once_over_the_ranks():
    """Chunks of batch_size in file order, chunk c on rank c mod dp; equally many batches per rank, the
    padding ones weighted 0; every sample exactly once over the ranks, with its weight."""
    for samples, batch, dp in [(23, 4, 2), (24, 4, 2), (5, 4, 3), (9, 2, 1)]:
        seen: Counter[int] = Counter()
        counts = set()
        for rank in range(dp):
            sampler = EvalBatchSampler(samples, BatchLayout(batch, 1, dp, rank), "all")
            counts.add(len(sampler))
            assert len(sampler.weights) == len(sampler.batches)
            for indices, weight in zip(sampler.batches, sampler.weights):
                assert weight in (0, len(indices))
                seen.update(indices if weight else [])
        assert len(counts) == 1 and counts.pop() == math.ceil(math.ceil(samples / batch) / dp)
        assert sorted(seen) == list(range(samples)) and set(seen.values()) == {1}


@pytest.mark.parametrize(("samples", "batch", "dp"), [(23, 4, 2), (5, 4, 3), (2877, 8, 2)])
def test_the_whole_held_out_loss_is_the_mean_over_every_window(samples, batch, dp):
    """Each rank's batch means, weighted by their real rows (the padding ones by 0) and summed over the ranks
    (here in one call: the all-reduce is a sum), are the plain mean of every window's loss; a plain mean of
    the batch means is not, when the last batch is short or a rank pads. Per-window losses spread widely."""
    window_loss = torch.rand(samples, generator=torch.Generator().manual_seed(samples), dtype=torch.float64) * 10
    means, weights = [], []
    for rank in range(dp):
        sampler = EvalBatchSampler(samples, BatchLayout(batch, 1, dp, rank), "all")
        means += [window_loss[indices].mean() for indices in sampler.batches]
        weights += sampler.weights
    assert len(means) == len(weights) == dp * len(sampler)
    expected = window_loss.mean().item()
    assert weighted_mean(torch.stack(means), weights) == pytest.approx(expected, rel=1e-12)
    assert abs(torch.stack(means).mean().item() - expected) > 1e-4  # what an unweighted mean would report


def test_max_epochs_sees_every_training_window_exactly_twice(tmp_path, monkeypatch):
    """2 epochs of a small data set whose window count the global batch divides: every window is read
    twice, counted where the loader reads it."""
    data = tokenized(tmp_path)
    read: Counter[int] = Counter()
    original = TokenWindows.__getitem__

    def counting(self, index):
        read[index] += 1
        return original(self, index)

    monkeypatch.setattr(TokenWindows, "__getitem__", counting)
    for seq_len in range(24, 48):  # a window length whose window count an even global batch divides
        windows = len(open_train_data(job_config(data, f"train.seq_len={seq_len}")).dataset)
        batch = next((g for g in range(40, 160, 2) if windows % g == 0), None)
        if batch is not None:
            break
    assert batch is not None and windows > 3 * batch
    read.clear()
    cfg = load_job_config(
        REPO / "presets" / "debug.toml",
        [
            *TINY,
            f"train.seq_len={seq_len}",
            f"model.max_seq_len={seq_len}",
            "model.vocab_size=512",
            f"data.dataset_path={data}",
            "data.num_workers=0",  # read in this process, where the count is kept
            f"train.batch_size={batch // 2}",
            f"train.global_batch_size={batch}",
            "train.max_epochs=2",
        ],
    )
    summary = train(cfg, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = max(r["step"] for r in records if "loss" in r)
    assert summary["steps"] == steps == 2 * windows // batch
    assert summary["tokens_seen"] == 2 * windows * seq_len
    assert len(read) == windows and set(read.values()) == {2}
    assert "max_steps" not in (tmp_path / "run" / "config.toml").read_text()  # derived again on resume
    assert summarize_run(tmp_path / "run").max_steps == steps  # forge runs: from the attempt's start record
    again = train(load_job_config(tmp_path / "run" / "config.toml"), tmp_path / "run")  # the steps derived again
    assert again["already_complete"] and again["steps"] == steps


RAMP = ["train.global_batch_size=32", "train.batch_ramp_start=8", "train.batch_ramp_steps=3"]


def test_global_batch_size_is_bitwise_the_explicit_accumulation(tmp_path):
    """global_batch_size = 32 with batch_size 8 on one process is grad_accum_steps = 4: the same computation.
    A ramp's first step (8 sequences: one micro-batch) is a plain one-micro-batch step: its loss is normalised
    by the step's own micro-batches, not the full batch's 4."""
    runs = {}
    for name, batch in [
        ("explicit", ["train.grad_accum_steps=4"]),
        ("global", ["train.global_batch_size=32"]),
        ("single", ["train.grad_accum_steps=1"]),
        ("ramp", [*RAMP, "scheduler.unit=tokens", "scheduler.warmup_steps=500"]),
    ]:
        overrides = [*TINY, "train.batch_size=8", "train.max_steps=3", *batch]
        train(load_job_config(REPO / "presets" / "debug.toml", overrides), tmp_path / name)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = [(r["loss"], r["grad_norm"], r["tokens_seen"]) for r in map(json.loads, lines) if "loss" in r]
        lrs = [r["lr"] for r in map(json.loads, lines) if "loss" in r]
    assert len(runs["global"]) == 3 and runs["global"] == runs["explicit"]
    assert runs["global"][-1][2] == 3 * 32 * 32
    assert runs["ramp"][0] == runs["single"][0]
    assert [tokens for _, _, tokens in runs["ramp"]] == [8 * 32, 24 * 32, 48 * 32]  # 8, 16, 24 sequences
    # the trainer's schedule (LambdaLR read at the plan's tokens) is `learning_rate`, whose closed form is
    # checked above: warmup in tokens at 0, 256 and 768 tokens before the step
    cfg = load_job_config(REPO / "presets" / "debug.toml", [*TINY, "train.batch_size=8", "train.max_steps=3", *RAMP])
    cfg = with_derived_length(
        check_config(
            cfg.model_copy(
                update={"scheduler": cfg.scheduler.model_copy(update={"unit": "tokens", "warmup_steps": 500})}
            ),
            1,
        ),
        1,
    )
    assert lrs == [learning_rate(cfg, s) for s in range(3)]
    assert lrs[:2] == pytest.approx([cfg.optimizer.lr * 1 / 501, cfg.optimizer.lr * 257 / 501], rel=1e-6)


def test_a_later_layer_says_the_length_or_batch_its_own_way(tmp_path):
    """An override (or a preset over its includes) that sets max_epochs or global_batch_size replaces the
    max_steps or grad_accum_steps an earlier layer set; within one layer, both are an error."""
    cfg = load_job_config(REPO / "presets" / "debug.toml", ["train.max_tokens=100000", "train.global_batch_size=32"])
    assert (cfg.train.max_steps, cfg.train.grad_accum_steps) == (None, None)
    assert with_derived_length(check_config(cfg, 1), 1).train.grad_accum_steps == 4
    base = tmp_path / "base.toml"
    base.write_text("[train]\nmax_steps = 10\ngrad_accum_steps = 2\n")
    (tmp_path / "child.toml").write_text('include = ["base.toml"]\n[train]\nmax_tokens = 5000\n')
    assert load_job_config(tmp_path / "child.toml").train.max_steps is None
    (tmp_path / "both.toml").write_text("[train]\nmax_tokens = 5000\nmax_steps = 3\n")
    with pytest.raises(ConfigError, match=r"train\.max_tokens: and train\.max_steps are both set"):
        check_config(load_job_config(tmp_path / "both.toml"), 1)


def forge(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "forgecli.app", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("overrides", "world", "expected"),
    [
        (
            ["--train.global_batch_size=30"],
            2,
            [
                (
                    "train.global_batch_size",
                    "30 is not a multiple of train.batch_size × data-parallel ranks = 8 × 2 = 16",
                )
            ],
        ),
        (
            ["--train.global_batch_size=64", "--train.batch_ramp_start=24", "--train.batch_ramp_steps=10"],
            2,
            [("train.batch_ramp_start", "24 is not a multiple of train.batch_size × data-parallel ranks = 8 × 2 = 16")],
        ),
        (
            ["--train.global_batch_size=64", "--train.batch_ramp_start=16", "--train.batch_ramp_increment=32"],
            1,
            [
                ("train.batch_ramp_steps", "is unset, and so is train.batch_ramp_tokens"),
                ("train.batch_ramp_increment", "rises of 32 do not lead from train.batch_ramp_start = 16"),
            ],
        ),
        (
            ["--train.max_epochs=2", "--train.max_steps=5"],
            1,
            [("train.max_epochs", "and train.max_steps are both set")],
        ),
        (
            ["--train.global_batch_size=32", "--train.grad_accum_steps=2"],
            1,
            [("train.grad_accum_steps", "2 disagrees with train.global_batch_size = 32")],
        ),
    ],
)
def test_bad_batch_and_length_exit_2_naming_the_fields(overrides, world, expected):
    result = forge("validate-config", "presets/debug.toml", *overrides, "--world-size", str(world), "--json")
    assert result.returncode == 2, result.stdout + result.stderr
    errors = json.loads(result.stdout)["errors"]
    assert len(errors) == len(expected), errors
    for (field, problem), error in zip(expected, errors):
        assert error["field"] == field and error["problem"].startswith(problem), error
    assert expected[0][0] in result.stderr  # the panel names it too


def test_forge_train_refuses_a_global_batch_that_does_not_divide_before_writing(tmp_path):
    result = forge("train", "presets/debug.toml", "--run-dir", str(tmp_path / "run"), "--train.global_batch_size=12")
    assert result.returncode == 2 and "train.global_batch_size" in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_validate_config_shows_the_derived_batch_ramp_and_length():
    ramp = [
        "--train.global_batch_size=64",
        "--train.batch_ramp_start=16",
        "--train.batch_ramp_steps=30",
        "--train.max_epochs=1",
    ]
    argv = [
        "forge",
        "validate-config",
        "presets/debug.toml",
        *ramp,
        "--scheduler.unit=tokens",
        "--world-size=2",
        "--json",
    ]
    code = (  # the plan, the epochs' window count and the schedule in tokens, all without torch
        f"import sys; sys.argv = {argv!r}\n"
        "from forgecli.app import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    length = out["length"]
    assert (length["global_batch_size"], length["grad_accum_steps"]) == (64, 4)  # 64 / (8 × 2 ranks)
    assert [row["sequences"] for row in length["batch_ramp"]] == [16, 32, 48, 64]
    assert [row["step"] for row in length["batch_ramp"]] == [1, 11, 21, 31]
    assert "epoch(s) of" in length["max_steps_from"] and out["config"]["train"]["max_steps"] == length["max_steps"]
    rows = {row["step"]: row for row in out["lr_schedule"]}
    assert {1, 11, 21, 31} <= rows.keys() and rows[11]["batch"] == 32 and rows[11]["tokens_before"] == 160 * 256
    text = forge("validate-config", "presets/debug.toml", *ramp, "--world-size", "2")
    assert text.returncode == 0 and "micro-batches per step per rank" in text.stdout
    assert "batch (sequences)" in text.stdout and "epoch(s) of " in text.stdout
