"""`forge scale`: the family rule against the presets, isoFLOP plans (their arithmetic is Forge's own FLOP count),
fits that recover the laws the losses were generated from (approach 3 within 5%, approach 2's exponent within
0.03, Chinchilla's a = β/(α+β) within 0.01), and a study end to end through the CLI on the embedded corpus:
plan, run (and a rerun that skips, a point that resumes), fit with a plot and a prediction, and bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import tomlkit
from typer.testing import CliRunner

from engine.config import load_job_config
from engine.config.model import ModelConfig
from engine.model.estimate import param_counts
from engine.plan import resolve
from engine.plan.summary import job_summary
from engine.resilience.signals import Preempted
from engine.scale.family import DEPTH_EXPONENT, member
from engine.scale.fit import CONFIDENCE, Law, approach2, approach3
from engine.scale.plan import make_plan
from engine.scale.study import RunPoint, fit_study, report
from engine.train.callbacks import Callback
from engine.train.trainer import train
from forgecli.app import app
from tests.conftest import REPO
from tests.helpers.scale import TINY

runner = CliRunner()
CHINCHILLA = Law(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)  # Hoffmann et al. 2022, eq. 10
TINY_PLAN = ["--budgets", "1.6e10,2.5e10", "--sizes-per-budget", "3", "--span", "2", "--tokens-per-param", "0.004"]


def forge(*args: str):
    return runner.invoke(app, list(args), env={"NO_COLOR": "1", "COLUMNS": "200"})


def flat(output: str) -> str:
    """A panel's text on one line (Rich wraps it)."""
    return " ".join(output.replace("│", " ").split())


# ----- the family rule and plans -----------------------------------------------------------------------------


def test_depth_exponent_is_the_slope_of_the_dense_presets():
    """n_layers ∝ dim^p: p by least squares of log n_layers on log dim over the dense presets 125m … 70b (the
    size ladder; the other presets copy one of its shapes with another block, e.g. mistral_small)."""
    dims, layers = [], []
    for name in ("125m", "350m", "760m", "1b", "1.3b", "3b", "7b", "8b", "13b", "34b", "70b"):
        model = tomllib.loads((REPO / "presets" / f"{name}.toml").read_text())["model"]
        dims.append(model["dim"])
        layers.append(model["n_layers"])
    assert len(dims) == 11
    slope = np.polyfit(np.log(dims), np.log(layers), 1)[0]
    assert round(slope, 2) == DEPTH_EXPONENT


@pytest.mark.parametrize("preset", ["125m", "8b", "debug"])
def test_the_preset_is_a_member_of_its_own_family(preset):
    base = load_job_config(REPO / "presets" / f"{preset}.toml")
    same = member(base.model, base.model.n_heads, base.train.seq_len)
    assert same.model == base.model
    assert same.params == param_counts(base.model)["total"]
    bigger = member(base.model, 2 * base.model.n_heads, base.train.seq_len).model
    assert (
        bigger.head_dim == base.model.head_dim
        and bigger.kv_heads / bigger.n_heads == base.model.kv_heads / base.model.n_heads
    )
    assert bigger.n_layers == round(base.model.n_layers * 2**DEPTH_EXPONENT)


def test_plan_points_spend_their_budget_by_forges_own_count(tmp_path):
    """Every point trains budget ÷ (validate-config's FLOPs per token) tokens, to within half a step; its config is
    a whole preset that evaluates at its last step; its sizes straddle ~20 tokens per parameter."""
    cfg = load_job_config(REPO / "presets" / "125m.toml")
    plan, configs = make_plan(cfg, "125m", [1e18, 1e19], sizes=5, span=3.0, world_size=8)
    assert len(plan.points) == 10 and len(configs) == 10
    for budget in (1e18, 1e19):
        points = [p for p in plan.points if p.budget == budget]
        assert len(points) == 5 and len({p.params for p in points}) == 5
        ratios = [p.tokens / p.params for p in points]
        assert ratios == sorted(ratios, reverse=True) and ratios[0] > 20 > ratios[-1]
        for p in points:
            point_cfg = configs[p.name]
            summary = job_summary(resolve(point_cfg, 8))
            assert summary["parameters"]["total"] == p.params
            assert summary["flops_per_token"] == p.flops_per_token
            assert summary["total_tokens"] == p.tokens == p.max_steps * plan.tokens_per_step
            assert abs(p.flops - budget) <= p.flops_per_token * plan.tokens_per_step / 2  # rounding to whole steps
            assert p.flops_6nd == 6 * p.params * p.tokens
            assert point_cfg.eval.enabled and point_cfg.eval.interval == p.max_steps
            assert point_cfg.scheduler.warmup_steps == max(1, round(375 * p.max_steps / 5000))
            assert point_cfg.optimizer == cfg.optimizer and point_cfg.data == cfg.data


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--budgets", "1e9"],
            "budget 1e+09: its smallest size would be ~2.67K parameters, below the family's "
            "smallest sensible model (dim 64, 2 layers, 2/2 heads, 656K)",
        ),
        (
            ["--budgets", "3e9", "--tokens-per-param", "0.0005", "--sizes-per-budget", "3"],
            "budget 3e+09 gives dim 96, 3 layers, 3/3 heads "
            "(1.12M parameters) only 5 steps of 128 tokens; at least 10 are needed",
        ),
        (["--budgets", "1e10,1.2e10"], "budgets 1e+10 and 1.2e+10 are less than 1.5× apart"),
        (["--budgets", "2.5e10", "--sizes-per-budget", "2"], "a parabola needs 3 sizes"),
    ],
)
def test_budgets_that_cannot_be_trained_are_refused_by_name(tmp_path, args, message):
    preset = tmp_path / "tiny.toml"
    preset.write_text(TINY)
    result = forge("scale", "plan", str(preset), *args, "--span", "2", "--out", str(tmp_path / "plan"))
    assert result.exit_code == 2, result.output
    assert message in flat(result.output)
    assert not (tmp_path / "plan").exists()


def test_an_moe_preset_is_refused():
    with pytest.raises(Exception, match="scaling plans are for dense families"):
        make_plan(load_job_config(REPO / "presets" / "debug_moe.toml"), "moe", [1e15], 3, 2.0)


# ----- fits --------------------------------------------------------------------------------------------------


def isoflop_grid(law: Law, budgets, sizes: int, span: float, center=None):
    """`sizes` models per budget, evenly in log N from center/span to center×span (default center: the law's own
    optimum), each trained on D = C / 6N."""
    n, d, c = [], [], []
    for budget in budgets:
        middle = law.optimal_params(budget) if center is None else center(budget)
        for t in np.linspace(-1, 1, sizes):
            n.append(middle * span**t)
            d.append(budget / (6 * n[-1]))
            c.append(budget)
    return np.array(n), np.array(d), np.array(c)


def test_approach3_recovers_the_law_within_5_percent_and_its_intervals_hold_it():
    """Losses from a known law with 0.1% log-normal noise (the spread of final losses between seeds of one
    config is of that order) over 4 budgets × 7 sizes: each parameter within 5% (the issue's bound), and each
    95% bootstrap interval contains the truth."""
    n, d, _ = isoflop_grid(CHINCHILLA, np.logspace(18, 21, 4), sizes=7, span=4.0)
    loss = CHINCHILLA.loss(n, d) * np.exp(np.random.default_rng(1).normal(0, 1e-3, len(n)))
    fit = approach3(n, d, loss, bootstrap=100, seed=0)
    intervals = fit.intervals()
    for name, truth in CHINCHILLA.as_dict().items():
        assert abs(getattr(fit.law, name) / truth - 1) < 0.05, (name, getattr(fit.law, name), truth)
        assert intervals[name][0] <= truth <= intervals[name][1], (name, intervals[name], truth)
    loss_at, (low, high) = fit.predict(1e10, 2e11)
    assert low <= loss_at <= high and abs(loss_at / CHINCHILLA.loss(1e10, 2e11) - 1) < 0.01


def test_approach3_reproduces_its_bootstrap_from_the_seed():
    n, d, _ = isoflop_grid(CHINCHILLA, np.logspace(18, 20, 3), sizes=5, span=3.0)
    loss = CHINCHILLA.loss(n, d) * np.exp(np.random.default_rng(2).normal(0, 2e-3, len(n)))
    first, again = (approach3(n, d, loss, bootstrap=20, seed=7).as_dict() for _ in range(2))
    assert first == again
    assert approach3(n, d, loss, bootstrap=20, seed=8).as_dict()["intervals"] != first["intervals"]


def noisy_study(seed: int) -> list[RunPoint]:
    """Runs of a known law (3 budgets × 5 sizes, 0.2% noise) as `forge scale fit` reads them from run folders."""
    n, d, c = isoflop_grid(CHINCHILLA, np.logspace(18, 20, 3), sizes=5, span=3.0)
    loss = CHINCHILLA.loss(n, d) * np.exp(np.random.default_rng(seed).normal(0, 2e-3, len(n)))
    return [
        RunPoint(f"run{i}", f"/runs/{i}", int(n[i]), int(d[i]), float(c[i]), 6.0 * int(n[i]) * int(d[i]), loss[i])
        for i in range(len(n))
    ]


def test_the_study_fit_resamples_with_the_seed_it_is_given():
    """What `forge scale fit --seed S` calls (engine.scale.study.fit_study, then report): one seed gives the same
    bootstrap intervals twice and reports itself, another seed other intervals (20 resamples of 15 runs: two
    seeds drawing the same resamples has probability ~15^-300)."""
    points = noisy_study(2)
    first, again, other = (report(points, [], fit_study(points, 20, seed))["approach3"] for seed in (5, 5, 6))
    assert first == again and first["bootstrap"] == {"resamples": 20, "seed": 5}
    assert other["bootstrap"]["seed"] == 6
    for name in first["intervals"]:
        assert other["intervals"][name] != first["intervals"][name], name


def test_the_reported_interval_covers_its_confidence_of_the_bootstrap_refits():
    """The interval approach 3 reports as its `confidence` (95%, as `forge scale fit --help` and docs/scale.md
    say) leaves (1 − 0.95)/2 of the bootstrap refits out on each side: counted on the refits themselves, each
    parameter's, a's and the prediction's interval holds 0.95·B of the B values (linear interpolation between
    order statistics puts each end between two refits: the count is exact to within one per end)."""
    points = noisy_study(3)
    fit = fit_study(points, 200, 0)["approach3"]
    assert fit.as_dict()["confidence"] == CONFIDENCE == 0.95
    values = {name: np.array([getattr(b, name) for b in fit.boots]) for name in [*fit.intervals()]}
    intervals = dict(fit.intervals())
    n, d = 1e10, 2e11
    values["prediction"] = np.array([b.loss(n, d) for b in fit.boots])
    intervals["prediction"] = fit.predict(n, d)[1]
    for name, (low, high) in intervals.items():
        refits = values[name]
        below, above = (refits < low).sum(), (refits > high).sum()
        assert abs(below - 0.025 * len(refits)) <= 1 and abs(above - 0.025 * len(refits)) <= 1, (name, below, above)


def test_approach2_recovers_the_exponents_within_0_03():
    """A law with a = β/(α+β) = 3/7, 0.2% noise on the losses, 7 sizes per budget around its optimum: over 30
    seeds a's error has a standard deviation of ~0.005, so 0.03 is six of them."""
    law = Law(E=2.0, A=500.0, B=1000.0, alpha=0.4, beta=0.3)
    n, d, c = isoflop_grid(law, np.logspace(18, 21, 4), sizes=7, span=4.0)
    loss = law.loss(n, d) * np.exp(np.random.default_rng(3).normal(0, 2e-3, len(n)))
    fit = approach2(n, d, c, loss)
    assert fit.skipped is None and len(fit.budgets) == 4 and all(b.inside for b in fit.budgets)
    assert abs(fit.a - 3 / 7) < 0.03 and abs(fit.b - 4 / 7) < 0.03


def test_chinchilla_parameters_give_their_exponent_back_through_approach_2():
    """A plan's geometry (5 sizes per budget, span 3, centred on 20 tokens per parameter, not on the law's optimum),
    losses from Chinchilla's fitted law, parabolas fitted per budget: a comes back as β/(α+β) ≈ 0.452."""
    n, d, c = isoflop_grid(CHINCHILLA, np.logspace(18, 22, 5), sizes=5, span=3.0, center=lambda C: np.sqrt(C / 120))
    fit = approach2(n, d, c, CHINCHILLA.loss(n, d))
    assert len(fit.budgets) == 5 and all(len(b.runs) == 5 for b in fit.budgets)
    assert abs(fit.a - 0.28 / 0.62) < 0.01 and abs(fit.a + fit.b - 1) < 1e-9  # C = 6ND: a + b = 1 exactly


# ----- a study end to end ------------------------------------------------------------------------------------


class StopAt(Callback):
    """Sends this process SIGTERM before step `step`, as SLURM or a user would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def before_step(self, step: int, loop) -> None:
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> Path:
    """Plan 2 budgets × 3 sizes and train them here (in this process, as `forge scale run` does); point 0 is
    first started alone and stopped by SIGTERM at step 5, so the plan's run continues it rather than starting it."""
    root = tmp_path_factory.mktemp("scale")
    preset = root / "tiny.toml"
    preset.write_text(TINY)
    planned = forge("scale", "plan", str(preset), *TINY_PLAN, "--out", str(root / "plan"))
    assert planned.exit_code == 0, planned.output
    plan = json.loads((root / "plan" / "plan.json").read_text())
    first = plan["points"][0]
    with pytest.raises(Preempted):  # SIGTERM during step 5: an emergency checkpoint, as a preempted job leaves
        train(load_job_config(root / "plan" / first["config"]), root / "plan" / first["run_dir"], callbacks=[StopAt(5)])
    ran = forge("scale", "run", str(root / "plan"))
    assert ran.exit_code == 0, ran.output
    (root / "run.log").write_text(ran.output)
    return root


def test_a_plan_runs_every_point_and_resumes_an_interrupted_one(study):
    plan = json.loads((study / "plan" / "plan.json").read_text())
    points = plan["points"]
    assert len(points) == 6 and {p["budget"] for p in points} == {1.6e10, 2.5e10}
    log = (study / "run.log").read_text()
    assert f"[1/6] {points[0]['name']}: continuing" in log
    assert sum(": training (" in line for line in log.splitlines()) == 5
    first = study / "plan" / points[0]["run_dir"]
    starts = [json.loads(line) for line in (first / "attempts.jsonl").read_text().splitlines()]
    assert [s["event"] for s in starts] == ["start", "end", "start", "end"]
    for p in points:
        run = study / "plan" / p["run_dir"]
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "eval_loss" in r][-1] == p["max_steps"]
        saved, planned = load_job_config(run / "config.toml"), load_job_config(study / "plan" / p["config"])
        assert saved.model == planned.model and saved.train.max_steps == planned.train.max_steps == p["max_steps"]

    again = forge("scale", "run", str(study / "plan"))
    assert again.exit_code == 0 and again.output.count("complete, skipped") == 6, again.output


def test_fit_writes_the_fits_a_plot_and_a_prediction(study, tmp_path):
    plot = tmp_path / "scaling.png"
    result = forge(
        "scale", "fit", str(study / "plan"), "--plot", str(plot), "--predict", str(study / "tiny.toml"),
        "--tokens", "1e5", "--bootstrap", "20", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    plan = {p["name"]: p for p in json.loads((study / "plan" / "plan.json").read_text())["points"]}
    assert sorted(r["name"] for r in out["runs"]) == sorted(plan) and out["unfinished"] == []
    for run in out["runs"]:
        planned = plan[run["name"]]
        assert (run["params"], run["tokens"], run["flops"]) == (planned["params"], planned["tokens"], planned["flops"])
        assert run["flops_6nd"] == planned["flops_6nd"]
        records = [json.loads(line) for line in (Path(run["path"]) / "metrics.jsonl").read_text().splitlines()]
        assert run["loss"] == [r["eval_loss"] for r in records if "eval_loss" in r][-1]
    budgets = out["approach2"]["budgets"]
    assert len(budgets) == 2 and [len(b["runs"]) for b in budgets] == [3, 3]
    assert [{out["runs"][i]["name"].split("_")[0] for i in b["runs"]} for b in budgets] == [{"C1.6e10"}, {"C2.5e10"}]
    law = out["approach3"]["law"]
    assert out["approach3"]["bootstrap"] == {"resamples": 20, "seed": 0}
    for name, (low, high) in out["approach3"]["intervals"].items():
        assert low <= high and np.isfinite([low, high]).all(), name
    predicted = out["prediction"]
    assert (
        predicted["params"]
        == param_counts(ModelConfig(dim=64, n_layers=2, n_heads=2, vocab_size=4096, max_seq_len=32))["total"]
    )
    assert predicted["tokens"] == 100_000
    expected = law["E"] + law["A"] / predicted["params"] ** law["alpha"] + law["B"] / 1e5 ** law["beta"]
    assert predicted["loss"] == pytest.approx(expected, rel=1e-12)
    assert predicted["interval"][0] <= predicted["interval"][1]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 20_000

    seeded = json.loads(forge("scale", "fit", str(study / "plan"), "--bootstrap", "20", "--seed", "3", "--json").stdout)
    assert seeded["approach3"]["bootstrap"] == {"resamples": 20, "seed": 3}
    assert seeded["approach3"]["law"] == law and seeded["approach3"]["intervals"] != out["approach3"]["intervals"]

    shown = forge("scale", "fit", str(study / "plan"), "--bootstrap", "20")
    assert shown.exit_code == 0, shown.output
    assert "approach 3: L(N, D) = E + A/N^α + B/D^β" in shown.output and "a = β/(α+β)" in shown.output


def copy_runs(study: Path, to: Path) -> list[Path]:
    runs = sorted((study / "plan" / "runs").iterdir())
    copies = [to / run.name for run in runs if (run / "config.toml").is_file()]
    for run, copy in zip(runs, copies):
        shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints"))
    return copies


def set_field(section: str, key: str, value: str):
    """Changes (or adds) `key` in the run's saved config."""

    def change(run: Path) -> None:
        saved = tomllib.loads((run / "config.toml").read_text())
        saved[section][key] = value
        (run / "config.toml").write_text(tomlkit.dumps(saved))

    return change


def other_tokenizer(run: Path) -> None:
    (run / "tokenizer.json").write_text((run / "tokenizer.json").read_text() + " ")


@pytest.mark.parametrize(
    "change,kind,named",
    [
        (set_field("data", "dataset_path", "/elsewhere/shards"), "data", "data.dataset_path"),
        (set_field("model", "norm_type", "layernorm"), "family", "model.norm_type"),
        (other_tokenizer, "tokenizer", "tokenizer.json"),
    ],
)
def test_a_run_of_another_study_is_named(study, tmp_path, change, kind, named):
    runs = copy_runs(study, tmp_path)
    change(runs[3])
    result = forge("scale", "fit", *map(str, runs), "--bootstrap", "10")
    assert result.exit_code == 2, result.output
    assert f"{runs[3]} has a different {kind} from the other runs: {named}" in flat(result.output)


def test_too_few_runs_and_unfinished_runs(study, tmp_path):
    runs = copy_runs(study, tmp_path)
    few = forge("scale", "fit", *map(str, runs[:4]), "--bootstrap", "10")
    assert few.exit_code == 2, few.output
    assert "needs at least 6 finished runs" in flat(few.output) and "got 4" in flat(few.output)

    shutil.copytree(runs[5], tmp_path / "repeat")  # a seventh run, so that six remain when one is left out
    runs.append(tmp_path / "repeat")
    attempts = runs[0] / "attempts.jsonl"
    attempts.write_text("".join(attempts.read_text().splitlines(keepends=True)[:-1]))  # a start and no end: killed
    listed = forge("scale", "fit", *map(str, runs), "--bootstrap", "10", "--json")
    assert listed.exit_code == 0, listed.output
    out = json.loads(listed.stdout)
    assert len(out["runs"]) == 6 and runs[0].name not in {r["name"] for r in out["runs"]}
    assert [(u["name"], u["status"]) for u in out["unfinished"]] == [(runs[0].name, "failed")]
    assert out["unfinished"][0]["detail"].endswith("killed (no end recorded)")
    strict = forge("scale", "fit", *map(str, runs), "--strict", "--bootstrap", "10")
    assert strict.exit_code == 2, strict.output
    assert f"--strict: 1 run(s) have not finished: {runs[0]} (failed" in flat(strict.output)


def test_fit_of_a_study_still_training_exits_2_naming_the_runs_to_wait_for(study, tmp_path):
    """A freshly planned study (no run started) and one with a run still training (a start and no end): the
    documented plan → run → fit order run too early is a user error listing what has not finished."""
    preset = tmp_path / "tiny.toml"
    preset.write_text(TINY)
    assert forge("scale", "plan", str(preset), *TINY_PLAN, "--out", str(tmp_path / "plan")).exit_code == 0
    points = json.loads((tmp_path / "plan" / "plan.json").read_text())["points"]
    fresh = forge("scale", "fit", str(tmp_path / "plan"))
    assert fresh.exit_code == 2 and "Traceback" not in fresh.output, fresh.output
    assert "got 0, and 6 run(s) have not finished" in flat(fresh.output)
    for point in points:
        assert f"{tmp_path / 'plan' / point['run_dir']} (not started: no run yet)" in flat(fresh.output)

    runs = copy_runs(study, tmp_path / "copies")
    attempts = runs[0] / "attempts.jsonl"
    attempts.write_text("".join(attempts.read_text().splitlines(keepends=True)[:-1]))  # started, not ended
    started = forge("scale", "fit", *map(str, runs[:4]), "--bootstrap", "10")
    assert started.exit_code == 2 and "Traceback" not in started.output, started.output
    assert f"got 3, and 1 run(s) have not finished: {runs[0]} (failed" in flat(started.output)


def test_slurm_submission_is_one_array_of_the_points_own_configs(tmp_path):
    """--slurm --dry-run: one array task per point, each training its own config into its own run directory
    (bash itself reads the script's assignments); a job of another world size than the plan's is refused."""
    preset = tmp_path / "tiny.toml"
    preset.write_text(TINY)
    assert forge("scale", "plan", str(preset), *TINY_PLAN, "--out", str(tmp_path / "plan")).exit_code == 0
    points = json.loads((tmp_path / "plan" / "plan.json").read_text())["points"]
    result = forge("scale", "run", str(tmp_path / "plan"), "--slurm", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "#SBATCH --array=0-5" in result.stdout and "#SBATCH --job-name=scale-plan" in result.stdout
    body = result.stdout.split("\nmkdir -p")[0]
    for index, point in enumerate(points):
        shown = subprocess.run(
            ["bash", "-c", body + '\nprintf "%s\\n" "$PRESET" "$RUN_DIR"'],
            env={"SLURM_ARRAY_TASK_ID": str(index), "PATH": os.environ["PATH"]},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        assert shown == [str(tmp_path / "plan" / point["config"]), str(tmp_path / "plan" / point["run_dir"])]
    assert not (tmp_path / "plan" / "runs").exists()  # a dry run writes nothing

    other = forge("scale", "run", str(tmp_path / "plan"), "--slurm", "--dry-run", "--ntasks-per-node", "2")
    assert other.exit_code == 2 and "the plan was made for 1" in flat(other.output)
    local = forge("scale", "run", str(tmp_path / "plan"), "--nodes", "2")
    assert local.exit_code == 2 and "--nodes: only with --slurm" in flat(local.output)


def test_fit_without_scipy_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "scipy", None)  # `import scipy` now raises ImportError
    result = forge("scale", "fit", str(tmp_path))
    assert result.exit_code == 2 and "pip install 'forge-lm[scale]'" in flat(result.output)
