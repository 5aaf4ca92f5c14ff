"""The EMA of the weights (`train.ema_decay`): its formula, exact resume, FSDP against one process, and the
EMA as what `forge convert to-hf --ema` and `forge generate --ema` use."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.checkpoint.dcp import latest_checkpoint, read_state
from engine.checkpoint.hf import export_to_hf
from engine.config import load_job_config
from engine.errors import ConfigError, UserError
from engine.generate import load_model
from engine.model.transformer import Transformer
from engine.parallel.memory import estimate_memory
from engine.plan import check_config
from engine.train.ema import WeightAverage
from engine.train.trainer import train
from forgecli.dashboard import PlainReporter
from tests.helpers.convert import assert_same_logits, forge, said
from tests.helpers.faults import Faults
from tests.helpers.parity import U32

PRESET = Path(__file__).parents[2] / "presets" / "debug.toml"
TINY = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "train.seq_len=64",
    "model.max_seq_len=64",
    "train.batch_size=4",
    "train.max_steps=6",
    "metrics.log_interval=1",
    "eval.interval=3",
    "eval.steps=2",
    "checkpoint.interval=3",
    "scheduler.warmup_steps=1",
    "scheduler.decay_steps=5",  # pinned: a run first trained to step 3 continues the same schedule
]
EMA = ["train.ema_decay=0.9", "train.ema_warmup=true"]
N_PARAMS = 21  # TINY's parameter tensors: the embedding, 9 in each of the 2 blocks, the final norm, the head


def run(run_dir: Path, *overrides: str) -> list[dict]:
    train(load_job_config(PRESET, [*TINY, *overrides]), run_dir)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def saved(run_dir: Path, entry: str, step: int | None = None) -> dict[str, torch.Tensor]:
    """One entry ("model" or "ema") of a run's checkpoint (the newest, or step_`step`), as whole tensors."""
    path = latest_checkpoint(run_dir / "checkpoints")[1] if step is None else run_dir / "checkpoints" / f"step_{step}"
    model = Transformer(load_job_config(run_dir / "config.toml").model)
    tensors = {name: torch.empty_like(p) for name, p in model.named_parameters()}
    read_state(path, {entry: tensors})
    return tensors


def metrics(records: list[dict], *keys: str) -> dict[int, tuple]:
    return {r["step"]: tuple(r[k] for k in keys) for r in records if keys[0] in r}


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], n: int = N_PARAMS) -> None:
    """Every one of the `n` tensors equal bitwise (counted first, so an empty or partial dict cannot pass)."""
    assert len(expected) == n and actual.keys() == expected.keys(), (len(expected), actual.keys() ^ expected.keys())
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def test_the_decay_and_its_warmup_follow_the_documented_formula():
    model = torch.nn.Linear(3, 2)
    plain, warm = WeightAverage(model, 0.999, False), WeightAverage(model, 0.999, True)
    for step in (1, 2, 10, 100, 10_000):
        assert plain.decay_at(step) == 0.999
        assert warm.decay_at(step) == min(0.999, (1 + step) / (10 + step))
    assert warm.decay_at(1) == 2 / 11 and warm.decay_at(10_000) == 0.999


def test_with_decay_0_the_ema_is_the_weights_and_a_swap_restores_them_bitwise():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ema = WeightAverage(model, 0.0, False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    ema.update(1)
    assert len(ema.averages) == len(list(model.parameters())) == 2
    assert all(torch.equal(a, p) for a, p in zip(ema.averages, model.parameters()))

    half = WeightAverage(model, 0.5, False)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 / 3)  # weights that the average does not hold
    half.update(2)
    trained = [p.detach().clone() for p in model.parameters()]
    assert len(half.averages) == len(before) == len(trained) == 2
    with half.swapped_in():
        for p, b, t in zip(model.parameters(), before, trained):
            torch.testing.assert_close(p, b.lerp(t, 0.5), rtol=0, atol=0)
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), trained))


def test_a_decay_at_the_boundary_keeps_the_weights_through_training(tmp_path):
    """ema_decay = 1e-30 (1 − decay rounds to 1): the EMA holds exactly the weights after every step, so it
    evaluates and saves as they do."""
    records = run(tmp_path / "run", "train.ema_decay=1e-30")
    evals = metrics(records, "eval_loss", "eval_loss_ema")
    assert sorted(evals) == [3, 6]
    for loss, loss_ema in evals.values():
        assert loss == loss_ema
    assert_same(saved(tmp_path / "run", "ema"), saved(tmp_path / "run", "model"))


def test_keeping_an_ema_changes_no_loss_of_the_run(tmp_path):
    plain, with_ema = run(tmp_path / "plain"), run(tmp_path / "ema", *EMA)
    assert sorted(metrics(plain, "loss")) == [1, 2, 3, 4, 5, 6] and sorted(metrics(plain, "eval_loss")) == [3, 6]
    assert metrics(with_ema, "loss", "grad_norm") == metrics(plain, "loss", "grad_norm")
    assert metrics(with_ema, "eval_loss") == metrics(plain, "eval_loss")
    assert "eval_loss_ema" not in str(plain)


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_a_resumed_run_with_ema_equals_the_uninterrupted_one_bitwise(tmp_path, async_mode):
    mode = f"checkpoint.async_mode={async_mode}"
    whole = run(tmp_path / "whole", *EMA, mode)
    run(tmp_path / "split", *EMA, mode, "train.max_steps=3")
    resumed = run(tmp_path / "split", *EMA, mode)  # continues from step_3
    assert sorted(metrics(whole, "loss")) == [1, 2, 3, 4, 5, 6]
    assert metrics(resumed, "loss", "grad_norm") == metrics(whole, "loss", "grad_norm")
    assert metrics(resumed, "eval_loss", "eval_loss_ema") == metrics(whole, "eval_loss", "eval_loss_ema")
    assert set(metrics(whole, "eval_loss_ema")) == {3, 6}
    expected = saved(tmp_path / "whole", "ema")
    assert_same(saved(tmp_path / "split", "ema"), expected)
    weights = saved(tmp_path / "whole", "model")
    assert not all(torch.equal(expected[name], weights[name]) for name in weights)  # an average, not the weights


def test_ema_turned_on_for_a_resumed_run_starts_from_the_restored_weights(tmp_path, parity):
    run_dir = tmp_path / "run"
    run(run_dir, "train.max_steps=3")
    records = run(run_dir, "train.ema_decay=0.9", "train.max_steps=4")
    assert sorted(metrics(records, "loss")) == [1, 2, 3, 4]  # the run went on to step 4
    w3, w4, ema = saved(run_dir, "model", 3), saved(run_dir, "model", 4), saved(run_dir, "ema", 4)
    assert len(w4) == N_PARAMS
    # one update from step 3's weights: 0.9 · w3 + 0.1 · w4, one fp32 lerp each way (≤ 2 roundings of max|w|)
    assert sorted(ema) == sorted(w4)
    bound = 4 * U32 * max(t.abs().max().item() for t in [*w3.values(), *w4.values()])
    expected = {name: w3[name].lerp(w4[name], 1 - 0.9) for name in w4}
    parity.close(ema, expected, atol=bound, what="EMA after one update")


def test_the_plain_progress_lines_show_the_ema_eval_loss():
    out = io.StringIO()
    PlainReporter(out).on_eval(3, {"eval_loss": 2.5, "eval_perplexity": 12.18, "eval_loss_ema": 2.25})
    assert out.getvalue().strip().endswith("eval step 3 loss=2.5000 perplexity=12.18 ema_loss=2.2500")


def test_a_rollback_restores_the_ema_with_the_weights(tmp_path):
    """NaN weights after step 5 (so a NaN EMA too) are found at step 6's checkpoint: the run rolls back to step 3,
    EMA included, and saves that."""
    run_dir = tmp_path / "run"
    cfg = load_job_config(PRESET, [*TINY, *EMA])
    summary = train(cfg, run_dir, callbacks=[Faults(nan_weight_steps=[5])])
    assert summary["rollbacks"] == 1
    assert_same(saved(run_dir, "ema", 6), saved(run_dir, "ema", 3))


@pytest.mark.parametrize("tied", [False, True])
def test_the_ema_export_loads_in_transformers_with_the_ema_weights(tmp_path, tied, parity):
    transformers = pytest.importorskip("transformers")
    run_dir = tmp_path / "run"
    run(run_dir, *EMA, "train.max_steps=3", f"model.tie_embeddings={str(tied).lower()}")
    ema = saved(run_dir, "ema")
    export_to_hf(run_dir, tmp_path / "hf", ema=True)
    export_to_hf(run_dir, tmp_path / "hf-raw")
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), ema["tok_embeddings.weight"])
    with safe_open(tmp_path / "hf-raw" / "model.safetensors", "pt") as f:
        assert not torch.equal(f.get_tensor("model.embed_tokens.weight"), ema["tok_embeddings.weight"])

    model, _ = load_model(run_dir, torch.device("cpu"), ema=True)  # what forge generate --ema samples from
    assert_same(dict(model.named_parameters()), ema, N_PARAMS - tied)  # tied: no separate head
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert_same_logits(parity, hf, model, torch.randint(0, model.cfg.vocab_size, (2, 32)))


def test_ema_is_refused_where_the_run_kept_none(tmp_path):
    run(tmp_path / "run", "train.max_steps=3")
    with pytest.raises(UserError, match="holds no EMA"):
        load_model(tmp_path / "run", torch.device("cpu"), ema=True)
    for command in (["convert", "to-hf", "--out", str(tmp_path / "hf")], ["generate", "-n", "2"]):
        result = forge(*command, str(tmp_path / "run"), "--ema")
        assert result.exit_code == 2 and "holds no EMA" in said(result), result.output
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    ("overrides", "field", "message"),
    [
        (["train.ema_warmup=true"], "train.ema_warmup", "the EMA is off"),
        (
            ["train.ema_decay=0.99", "distributed.pp=2", "distributed.dp_shard=1", "train.grad_accum_steps=2"],
            "train.ema_decay",
            "pipeline parallelism",
        ),
        (
            ["train.ema_decay=0.99", "optimizer.name=schedule_free_adamw", "scheduler.name=constant"],
            "train.ema_decay",
            "already averages",
        ),
    ],
)
def test_unsupported_ema_settings_are_refused(overrides, field, message):
    cfg = load_job_config(PRESET, [*TINY, *overrides])
    with pytest.raises(ConfigError) as err:
        check_config(cfg, world_size=2)
    assert any(issue.path == field and message in issue.problem for issue in err.value.issues), err.value.issues


def test_the_memory_estimate_counts_the_ema_as_an_fp32_copy_of_the_sharded_params():
    plain = estimate_memory(check_config(load_job_config(PRESET, TINY), world_size=2), 2)[0]
    with_ema = estimate_memory(check_config(load_job_config(PRESET, [*TINY, *EMA]), world_size=2), 2)[0]
    assert with_ema.optimizer == plain.optimizer + plain.params
    assert with_ema.total == plain.total + plain.params


@pytest.mark.parametrize("decay", ["1.0", "-0.1"])
def test_the_decay_must_lie_in_0_1(decay):
    with pytest.raises(ConfigError, match=r"train\.ema_decay"):
        load_job_config(PRESET, [f"train.ema_decay={decay}"])


@pytest.mark.slow
def test_ema_under_fsdp_on_two_processes_equals_one_process(tmp_path, parity):
    """fp32 runs: the tolerances of tests/helpers/parity.TrainingTolerance (the EMA, a convex combination of the
    weights, within the weights' own)."""
    from tests.helpers.layouts import forge, records, tolerance

    ema = ["--train.ema_decay=0.9", "--train.ema_warmup=true"]
    for name, nproc in (("single", 1), ("fsdp", 2)):
        result = forge(tmp_path / name, *ema, nproc=nproc)
        assert result.returncode == 0, result.stderr[-3000:]
    assert list((tmp_path / "fsdp" / "checkpoints" / "step_6").glob("__1_*.distcp"))  # rank 1 wrote its shards
    tol = tolerance(tmp_path / "single")
    reference = records(tmp_path / "single")
    ours = records(tmp_path / "fsdp")
    assert sorted(ours) == sorted(reference) == list(range(1, 7))
    for step, record in ours.items():  # evaluating at the EMA leaves training as it was
        parity.within(f"loss step {step}", abs(record["loss"] - reference[step]["loss"]), tol.loss_at(step))
    single, fsdp = records(tmp_path / "single", "eval_loss_ema"), records(tmp_path / "fsdp", "eval_loss_ema")
    assert sorted(fsdp) == [3, 6]
    for step in fsdp:
        gap = abs(fsdp[step]["eval_loss_ema"] - single[step]["eval_loss_ema"])
        parity.within(f"EMA eval loss step {step}", gap, tol.loss_at(step + 1))
    expected, got = saved(tmp_path / "single", "ema"), saved(tmp_path / "fsdp", "ema")
    assert len(got) == 4 * 9 + 3 and sorted(got) == sorted(expected)  # the layouts' 4-block model
    largest = max(t.abs().max().item() for t in expected.values())
    bound = tol.weights([reference[step]["lr"] for step in sorted(reference)], largest)
    parity.close(got, expected, atol=bound, what="EMA weights")
