"""Dataset mixtures (engine.data.mixture): temperature, shares, phases, layout independence, exact resume,
epoch reuse, bad input, and the mixture preset end to end."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.config import load_job_config
from engine.data.mixture import SourceDraws, mixture_phases, temperature_weights
from engine.data.sampler import BatchLayout, EpochOrder, MixtureBatchSampler
from engine.errors import ConfigError
from engine.plan import check_config
from engine.train.callbacks import Callback
from engine.train.schedules import learning_rate
from tests.conftest import REPO
from tests.helpers.parity import SIGMAS, U64, forward_lengths, rounding_sigma


def mixture(*overrides: str, max_steps: int = 100):
    return load_job_config(
        None,
        [
            f"--train.max_steps={max_steps}",
            "--scheduler.name=constant",
            "--scheduler.warmup_steps=0",
            '--data.datasets=[{name="a", path="/a", weight=6.0}, {name="b", path="/b", weight=3.0}, '
            '{name="c", path="/c", weight=1.0}]',
            *overrides,
        ],
    )


def test_temperature_formula():
    assert temperature_weights([1, 3], 1.0) == pytest.approx([0.25, 0.75], abs=1e-12)
    assert temperature_weights([1, 4], 2.0) == pytest.approx([1 / 3, 2 / 3], abs=1e-12)  # sqrt weights
    assert temperature_weights([1, 1000], 1e6) == pytest.approx([0.5, 0.5], abs=1e-5)  # T → ∞: uniform
    assert temperature_weights([1e300, 1e-300], 0.01).tolist() == [1.0, 0.0]  # no overflow at small T


def test_source_shares_match_the_temperature_adjusted_weights(parity):
    """2,000 steps × 64 positions = 128,000 draws. Each source's count is Binomial(n, p_i); the test allows
    4 standard deviations (a false failure has probability < 1e-4 per source; the seed is fixed, so the
    outcome is deterministic). At n = 128,000 that is a share within about ±0.5 percentage points."""
    cfg = mixture("--data.mix_temperature=2.0")
    probs = np.array(mixture_phases(cfg.data)[0].probabilities)
    expected = temperature_weights([6, 3, 1], 2.0)
    # the closed form, float64: a power and a normalisation of 3 numbers (≤ 10 roundings of values ≤ 1)
    parity.within("probabilities against the closed form", float(np.abs(probs - expected).max()), 10 * U64)
    draws = SourceDraws(mixture_phases(cfg.data), global_batch=64, seed=7)
    counts = draws.before(2000)
    n = 2000 * 64
    assert counts.sum() == n and len(counts) == 3
    sigma = np.sqrt(n * probs * (1 - probs))
    assert np.all(np.abs(counts - n * probs) <= 4 * sigma), (counts / n, probs)
    # and the weights as given (T = 1) are not what was drawn: the temperature mattered
    assert np.abs(counts / n - np.array([0.6, 0.3, 0.1])).max() > 0.05


def test_phases_switch_at_exactly_their_start_step():
    cfg = mixture(
        "--data.phases=[{start_step=10, dataset_weights={c=1.0}, lr_scale=0.5}, "
        "{start_step=20, dataset_weights={a=1.0, b=1.0}, lr_scale=0.25}]",
        "--optimizer.lr=1e-3",
    )
    phases = mixture_phases(cfg.data)
    assert [p.start_step for p in phases] == [0, 10, 20]
    draws = SourceDraws(phases, global_batch=32, seed=1)
    assert set(draws.sources_of(9).tolist()) == {0, 1, 2}
    assert set(draws.sources_of(10).tolist()) == {2} == set(draws.sources_of(19).tolist())
    assert set(draws.sources_of(20).tolist()) == {0, 1}
    lrs = [learning_rate(cfg, s) for s in (9, 10, 19, 20)]
    assert lrs == pytest.approx([1e-3, 5e-4, 5e-4, 2.5e-4], abs=1e-15)
    # the anneal shorthand is one last phase with lr_scale 1
    anneal = mixture("--data.anneal_start_step=50", "--data.anneal_weights={b=2.0}")
    assert [(p.start_step, p.probabilities, p.lr_scale) for p in mixture_phases(anneal.data)][1] == (
        50,
        (0.0, 1.0, 0.0),
        1.0,
    )


def global_batches(layout_args: list[tuple[int, int, int]], steps: range, start_step: int = 0) -> list[list[int]]:
    """The samples of each step's global batch, gathered from every rank's sampler of a layout
    (batch_size, grad_accum_steps, dp_size), in rank-and-micro-step order of the stream positions."""
    phases = mixture_phases(mixture("--data.anneal_start_step=6", "--data.anneal_weights={c=1.0}").data)
    sizes, offsets = [50, 30, 7], [0, 50, 80]  # c has 7 windows: it runs out and is reused
    out: dict[int, dict[int, list[int]]] = {}
    for batch, accum, dp in layout_args:
        for rank in range(dp):
            layout = BatchLayout(batch, accum, dp, rank)
            draws = SourceDraws(phases, layout.global_batch, seed=3)
            orders = [EpochOrder(n, (3, i)) for i, n in enumerate(sizes)]
            sampler = iter(MixtureBatchSampler(draws, orders, offsets, layout, start_step))
            for step in range(start_step, steps.stop):
                for micro in range(accum):
                    first = layout.micro_batch_start(step, micro) - step * layout.global_batch
                    indices = next(sampler)
                    out.setdefault(step, {}).update({first + k: index for k, index in enumerate(indices)})
    return [[out[s][p] for p in sorted(out[s])] for s in steps]


def test_same_global_batches_under_any_layout_and_after_a_resume():
    steps = range(12)
    one = global_batches([(8, 1, 1)], steps)
    assert len(one) == 12 and all(len(b) == 8 for b in one)
    assert global_batches([(2, 2, 2)], steps) == one  # 2 ranks × 2 micro-steps
    assert global_batches([(4, 1, 2)], steps) == one
    assert global_batches([(8, 1, 1)], range(5, 12), start_step=5) == one[5:]  # resumed mid-run, before the anneal
    assert global_batches([(2, 2, 2)], range(8, 12), start_step=8) == one[8:]  # resumed inside the anneal
    # from step 6 the anneal draws only c (indices 80…86): 48 draws of 7 windows, every epoch a permutation
    annealed = [i - 80 for batch in one[6:] for i in batch]
    assert min(annealed) >= 0 and len(annealed) == 48
    c_draws = [i - 80 for batch in one for i in batch if i >= 80]
    epochs = [c_draws[k : k + 7] for k in range(0, len(c_draws) - 6, 7)]
    assert len(epochs) >= 6 and all(sorted(e) == list(range(7)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1, "each epoch is shuffled anew"


@pytest.mark.parametrize(
    "override,field",
    [
        ('--data.datasets=[{name="a", path="/a", weight=0.0}]', "data.datasets.0.weight"),
        ('--data.datasets=[{name="a", path="/a", weight=-1.0}]', "data.datasets.0.weight"),
        ("--data.phases=[{start_step=5, dataset_weights={d=1.0}}]", "data.phases.0.dataset_weights"),
        ("--data.phases=[{start_step=5, dataset_weights={a=0.0}}]", "data.phases.0.dataset_weights.a"),
        (
            "--data.phases=[{start_step=9, dataset_weights={a=1.0}}, {start_step=5, dataset_weights={b=1.0}}]",
            "data.phases.1.start_step",
        ),
        ("--data.phases=[{start_step=100, dataset_weights={a=1.0}}]", "data.phases.0.start_step"),
        ("--data.anneal_start_step=50", "data.anneal_weights"),
        ("--data.dataset_path=/x", "data.dataset_path"),
        ('--data.datasets=[{name="a"}]', "data.datasets.0.path"),
        ('--data.datasets=[{name="a", path="/a", embedded="poems"}]', "data.datasets.0.embedded"),
        ('--data.datasets=[{name="a", path="/a", hf_split="test"}]', "data.datasets.0.hf_split"),
        ('--data.datasets=[{name="a", hf_name="org/set"}]', "data.tokenizer_path"),
    ],
)
def test_bad_mixtures_name_the_field(override, field):
    with pytest.raises(ConfigError) as raised:
        check_config(mixture(override))
    assert field in [issue.path for issue in raised.value.issues], raised.value.issues


def forge(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    command = [sys.executable, "-m", "forgecli.app", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def logged(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


TINY = [
    "--model.dim=32",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--train.seq_len=64",
    "--model.max_seq_len=64",
    "--train.batch_size=4",
    "--train.max_steps=8",
    "--scheduler.warmup_steps=2",
    "--data.anneal_start_step=3",
    "--metrics.log_interval=1",
    "--eval.interval=8",
    "--eval.steps=1",
    "--checkpoint.interval=4",
]


def test_mixture_preset_trains_switches_phase_and_resumes_bitwise(tmp_path):
    """presets/mixture_debug.toml as a user runs it (shrunk), then resumed from its checkpoint at step 4, in
    the middle of its anneal phase (which starts after step 3): the resumed steps repeat the uninterrupted
    losses bitwise. The poems source gets a held-out set of its own, here the same works as the main eval
    set, so its eval_loss/poems must equal eval_loss."""
    from engine.data.embedded import embedded_corpus

    val = embedded_corpus().val
    sources = (
        f'--data.datasets=[{{name="plays", embedded="plays", weight=9.0}}, '
        f'{{name="poems", embedded="poems", weight=1.0, eval_path="{val}"}}]'
    )
    whole = tmp_path / "whole"
    result = forge("train", "presets/mixture_debug.toml", "--run-dir", str(whole), *TINY, sources)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = logged(whole)
    assert [r["step"] for r in rows] == list(range(1, 9))
    plays = [r["data/tokens/plays"] for r in rows]
    poems = [r["data/tokens/poems"] for r in rows]
    assert [a + b for a, b in zip(plays, poems)] == [64 * 4 * s for s in range(1, 9)]
    assert plays[2] > 0 and plays[2:] == [plays[2]] * 6, "from step 4 on only the poems are drawn"
    assert poems[3] - poems[2] == poems[7] - poems[6] == 64 * 4
    # resume: the run as it was when step 4's checkpoint was written, then trained on
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_8")
    lines = (resumed / "metrics.jsonl").read_text().splitlines(keepends=True)
    (resumed / "metrics.jsonl").write_text("".join(line for line in lines if json.loads(line).get("step", 0) <= 4))
    result = forge("train", "presets/mixture_debug.toml", "--run-dir", str(resumed), *TINY, sources)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    again = logged(resumed)
    assert [r["step"] for r in again] == list(range(1, 9))
    assert [(r["loss"], r["grad_norm"], r["data/tokens/poems"]) for r in again] == [
        (r["loss"], r["grad_norm"], r["data/tokens/poems"]) for r in rows
    ]
    evals = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]
    assert len(evals) == 1 and evals[0]["step"] == 8
    assert math.isfinite(evals[0]["eval_loss"]) and evals[0]["eval_loss/poems"] == evals[0]["eval_loss"]


def test_bad_sources_are_refused_naming_the_field(tmp_path):
    """A missing path, and a source tokenized with another tokenizer: DataError (the CLI's exit 2) naming the
    entry, raised by opening the data, which build_job does before any process group starts."""
    from engine.data.loader import open_train_data
    from engine.errors import DataError
    from tests.helpers.data_fixtures import tokenized

    missing = load_job_config(None, [f'--data.datasets=[{{name="gone", path="{tmp_path / "nowhere"}"}}]'])
    with pytest.raises(DataError) as raised:
        open_train_data(check_config(missing))
    assert "data.datasets.0.path" in raised.value.message
    own = tokenized(tmp_path)  # the test tokenizer (vocab 400), not the embedded corpus's
    cfg = load_job_config(
        None,
        [
            "--train.seq_len=16",
            f'--data.datasets=[{{name="own", path="{own}"}}, {{name="poems", embedded="poems"}}]',
        ],
    )
    with pytest.raises(DataError) as raised:
        open_train_data(check_config(cfg))
    assert "data.datasets.1.embedded" in raised.value.message and "different tokenizer" in raised.value.message


def test_validate_config_prints_the_phase_table_and_the_scaled_lr(tmp_path):
    """The preset's phases after temperature (9 : 1 at T = 2 → 75 % / 25 %), with tokens per source, and the
    lr table showing a phase's lr_scale from its first step."""
    result = forge(
        "validate-config",
        "presets/mixture_debug.toml",
        "--data.anneal_start_step=200",
        "--scheduler.name=constant",
        "--scheduler.warmup_steps=0",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    table = result.stdout[result.stdout.index("Data mixture") :]
    assert "mix_temperature = 2" in table
    assert "1–200" in table and "75.0% · 307.20 k tok" in table and "25.0% · 102.40 k tok" in table
    assert "201–300" in table and "100.0% · 204.80 k tok" in table
    preset = tmp_path / "phases.toml"
    preset.write_text(
        '[train]\nmax_steps = 300\n[optimizer]\nlr = 2e-3\n[scheduler]\nname = "constant"\nwarmup_steps = 0\n'
        '[[data.datasets]]\nname = "plays"\nembedded = "plays"\n[[data.datasets]]\nname = "poems"\n'
        'embedded = "poems"\n[[data.phases]]\nstart_step = 200\ndataset_weights = { poems = 1.0 }\nlr_scale = 0.1\n'
    )
    scaled = forge("validate-config", str(preset))
    assert scaled.returncode == 0, scaled.stdout + scaled.stderr
    lr_rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in scaled.stdout.splitlines()
               if line.count("│") == 3 and line.split("│")[1].strip().replace(",", "").isdigit()}  # fmt: skip
    assert lr_rows["200"] == "2.000e-03" and lr_rows["201"] == "2.000e-04", lr_rows


class WeightsBeforeEachStep(Callback):
    """A callback that keeps a copy of the weights each step starts from."""

    def __init__(self) -> None:
        self.weights: dict[int, dict] = {}

    def before_step(self, step, loop) -> None:
        self.weights[step] = {k: v.detach().clone() for k, v in loop.job.model.state_dict().items()}


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "chunked_cross_entropy"])
def test_per_source_loss_equals_a_recomputation_by_source(tmp_path, loss_fn, parity):
    """A 2-source mixture trained in process (2 steps of 2 accumulated micro-batches): each step's logged
    `loss/NAME` equals the mean of torch's own per-token cross-entropy (reduction='none') over the rows
    drawn from NAME, recomputed from the weights the step started from on the step's batches (1e-5)."""
    import torch
    import torch.nn.functional as F

    from engine.data.loader import open_train_data
    from engine.model.transformer import Transformer
    from engine.train.trainer import train

    sources = '[{name="plays", embedded="plays", weight=1.0}, {name="poems", embedded="poems", weight=1.0}]'
    cfg = load_job_config(
        REPO / "presets" / "debug.toml",
        [
            *TINY[:6],
            "--train.batch_size=3",
            "--train.grad_accum_steps=2",
            "--train.max_steps=2",
            "--metrics.log_interval=1",
            "--eval.enabled=false",
            "--train.mixed_precision=fp32",
            "--train.z_loss_weight=1e-3",  # the per-source loss is plain CE: z-loss must not leak into it
            f"--train.loss_fn={loss_fn}",
            *(["--train.ce_chunk_size=40"] if loss_fn == "chunked_cross_entropy" else []),  # chunks across rows
            f"--data.datasets={sources}",
        ],
    )
    hooks = WeightsBeforeEachStep()
    train(cfg, tmp_path / "run", callbacks=[hooks])
    rows = logged(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and sorted(hooks.weights) == [1, 2]
    cfg = check_config(cfg)
    batches = open_train_data(cfg).batches()
    model = Transformer(cfg.model)
    for row in rows:
        model.load_state_dict(hooks.weights[row["step"]])
        sums, counts = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
        for _ in range(2):
            inputs, labels, source = next(batches)
            with torch.no_grad():
                logits = model(inputs)
            tokens = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
            sums.index_add_(0, source, tokens.double().sum(1))
            counts.index_add_(0, source, torch.full((len(source),), float(labels.shape[1]), dtype=torch.float64))
        assert counts.sum() == 6 * 64
        drawn = [n for n, c in zip(("plays", "poems"), counts.tolist()) if c > 0]
        assert sorted(k for k in row if k.startswith("loss/")) == [f"loss/{n}" for n in drawn]
        for i, name in enumerate(("plays", "poems")):
            if counts[i] > 0:
                # fp32 token losses through the same model by two routes (the trainer's loss and F.cross_entropy
                # here): each off by σ_f·|loss| (parity.rounding_sigma of forward_lengths), both ways (×√2),
                # averaged over the source's tokens, at least one row of seq_len
                sigma = rounding_sigma(forward_lengths(cfg.model, cfg.train.seq_len))
                tol = SIGMAS * math.sqrt(2) * sigma * math.log(cfg.model.vocab_size) / math.sqrt(cfg.train.seq_len)
                parity.within(f"loss/{name}", abs(row[f"loss/{name}"] - (sums[i] / counts[i]).item()), tol)
        # without z-loss the token-weighted mean of the sources is the step's CE; with it, loss is higher
        assert (sums.sum() / counts.sum()).item() < row["loss"]
    both = [r for r in rows if "loss/plays" in r and "loss/poems" in r]
    assert both and abs(both[0]["loss/plays"] - both[0]["loss/poems"]) > 1e-3, "the sources' losses differ"


def test_per_source_totals_stay_exact_past_2_to_the_24_tokens():
    """A big run's step adds more than 2^24 tokens of a source (global batch × tp copies), where fp32 stops
    counting by ones: the sums and counts are float64, so 2^24 tokens of loss 1 and one of loss 3 give
    exactly (2^24 + 3) / (2^24 + 1)."""
    import torch

    from engine.train.source_losses import SourceLosses

    tally = SourceLosses(("big",), torch.device("cpu"))
    tally.add(torch.ones(1, 1).expand(1, 2**24), torch.tensor([0]))  # a view: no 64 MB of ones
    tally.add(torch.full((1, 1), 3.0), torch.tensor([0]))
    assert tally.metrics() == {"loss/big": (2**24 + 3) / (2**24 + 1)}
