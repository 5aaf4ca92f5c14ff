"""Hostile and bad input through the `forge` commands: each refused with exit code 2 and a message that names
the input, no traceback, and nothing written. One section per kind of input, each headed `# ---- NAME ----`."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.checkpoint.verify import file_checksum
from engine.config.loader import dump_toml, load_job_config
from forgecli.app import app
from tests.conftest import REPO
from tests.helpers.runs import TINY as TINY_RUN
from tests.helpers.runs import forge as forge_subprocess
from tests.helpers.scale import TINY as TINY_STUDY

# ---- bad input exits 2 ----


def run_forge(*args: str):
    """`forge ARGS` in this process, its stdout and stderr apart."""
    return CliRunner().invoke(app, list(args), env={"NO_COLOR": "1", "COLUMNS": "200"})


def one_line(text: str) -> str:
    """A panel's text on one line (Rich wraps long messages inside the box)."""
    return " ".join(text.translate(str.maketrans("│╭╮╰╯─", "      ")).split())


def assert_refused(result, *named: str) -> None:
    """Exit code 2, every `named` string in the message, and no traceback."""
    output = result.stdout + result.stderr
    assert result.exit_code == 2, (output, result.exception)
    assert "Traceback" not in output
    for name in named:
        assert name in one_line(result.stderr), result.stderr


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` and its bytes: equal before and after a refused command means it wrote nothing."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def finished_study(root: Path) -> list[Path]:
    """Six run directories that look finished (config, a final held-out loss, an attempt that ended complete)
    without training them: `forge scale fit` reads nothing else."""
    (root / "tiny.toml").write_text(TINY_STUDY)
    runs = []
    for i, dim in enumerate([64, 128, 192, 64, 128, 192]):
        cfg = load_job_config(root / "tiny.toml", [f"--model.dim={dim}", f"--train.max_steps={10 + 10 * i}"])
        run = root / f"run{i}"
        run.mkdir()
        (run / "config.toml").write_text(dump_toml(cfg))
        steps = cfg.train.max_steps
        logged = [
            {"step": steps, "loss": 3.0, "tokens_seen": 128 * steps},
            {"step": steps, "eval_loss": 3 + 1 / (i + 1)},
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged))
        ended = [{"event": "start", "time": time.time()}, {"event": "end", "reason": "complete", "time": time.time()}]
        (run / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ended))
        runs.append(run)
    return runs


def test_a_finished_study_fits(tmp_path):
    """The study the bad inputs below are made from fits as it is: each refusal is the input's doing."""
    result = run_forge("scale", "fit", *map(str, finished_study(tmp_path)), "--bootstrap", "10")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("eval_loss", ["NaN", "Infinity", "-1.0", '"low"', "null"])
def test_scale_fit_refuses_a_final_loss_that_is_not_a_positive_number(tmp_path, eval_loss):
    runs = finished_study(tmp_path)
    metrics = runs[2] / "metrics.jsonl"
    train, evaluated = metrics.read_text().splitlines()
    evaluated = f'{{"step": {json.loads(evaluated)["step"]}, "eval_loss": {eval_loss}}}'  # JSON as Python writes NaN
    metrics.write_text(f"{train}\n{evaluated}\n")
    before = tree(tmp_path)
    result = run_forge("scale", "fit", *map(str, runs), "--bootstrap", "10", "--plot", str(tmp_path / "fit.png"))
    assert_refused(result, str(metrics), f"the final eval_loss is {eval_loss}")
    assert tree(tmp_path) == before


def test_scale_fit_names_a_run_config_that_is_not_utf8(tmp_path):
    runs = finished_study(tmp_path)
    (runs[4] / "config.toml").write_bytes(b"\xff\xfe[model]\n")
    before = tree(tmp_path)
    assert_refused(run_forge("scale", "fit", *map(str, runs), "--bootstrap", "10"), f"{runs[4]}/config.toml", "UTF-8")
    assert tree(tmp_path) == before


def plan_folder(root: Path) -> Path:
    (root / "tiny.toml").write_text(TINY_STUDY)
    plan = root / "plan"
    made = run_forge(
        "scale", "plan", str(root / "tiny.toml"), "--budgets", "1.6e10,2.5e10", "--sizes-per-budget", "3",
        "--span", "2", "--tokens-per-param", "0.004", "--out", str(plan),
    )  # fmt: skip
    assert made.exit_code == 0, made.output
    return plan


def edit_plan(change):
    def edit(plan: dict):
        change(plan)
        return plan

    return edit


@pytest.mark.parametrize(
    "change,named",
    [
        (edit_plan(lambda p: p.update(points=[])), "has no points"),
        (edit_plan(lambda p: p.pop("points")), "points is missing"),
        (edit_plan(lambda p: p["points"][1].update(max_steps="52")), 'points[1].max_steps = "52" is not of type int'),
        (edit_plan(lambda p: p["points"][0].update(extra=1)), "points[0].extra is not a field of a plan"),
        (lambda p: p["points"], "the plan is not a JSON object"),
    ],
)
def test_scale_fit_names_what_is_wrong_with_a_plan(tmp_path, change, named):
    plan = plan_folder(tmp_path)
    (plan / "plan.json").write_text(json.dumps(change(json.loads((plan / "plan.json").read_text()))))
    before = tree(tmp_path)
    assert_refused(run_forge("scale", "fit", str(plan), "--bootstrap", "10"), f"{plan}/plan.json", named)
    assert tree(tmp_path) == before


def test_scale_fit_of_a_plan_with_no_run_started_says_so(tmp_path):
    plan = plan_folder(tmp_path)
    assert_refused(run_forge("scale", "fit", str(plan), "--bootstrap", "10"), "needs at least 6 finished runs", "got 0")


@pytest.mark.parametrize("tokens", ["nan", "inf", "-inf", "0.5"])
def test_scale_fit_refuses_a_token_count_that_is_not_one(tmp_path, tokens):
    runs = finished_study(tmp_path)
    before = tree(tmp_path)
    plot = tmp_path / "fit.png"
    args = ["--predict", str(tmp_path / "tiny.toml"), "--tokens", tokens, "--plot", str(plot), "--bootstrap", "10"]
    assert_refused(run_forge("scale", "fit", *map(str, runs), *args), f"--tokens {tokens}", "positive, finite")
    assert tree(tmp_path) == before


def test_runs_lists_an_unreadable_run_with_its_problem_and_the_others_as_usual(tmp_path):
    runs = finished_study(tmp_path)
    (runs[1] / "config.toml").write_bytes(b"[train]\nmax_steps = \xff\n")
    (runs[3] / "config.toml").write_text("[train\n")
    before = tree(tmp_path)
    result = run_forge("runs", str(tmp_path), "--json")
    assert result.exit_code == 0, (result.output, result.exception)
    listed = {run["name"]: run for run in json.loads(result.stdout)}
    assert sorted(listed) == [run.name for run in runs]
    assert listed["run1"]["status"] == "unreadable" and "config.toml is not UTF-8" in listed["run1"]["detail"]
    assert listed["run3"]["status"] == "unreadable" and "config.toml is not valid TOML" in listed["run3"]["detail"]
    assert all(listed[f"run{i}"]["status"] == "complete" for i in (0, 2, 4, 5))
    shown = run_forge("runs", str(tmp_path))
    assert shown.exit_code == 0 and "unreadable" in shown.stdout and "Traceback" not in shown.output
    assert tree(tmp_path) == before


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """Four steps of a tiny model, with a checkpoint at the last."""
    run = tmp_path_factory.mktemp("trained") / "run"
    args = [*TINY_RUN, "--train.max_steps=4", "--checkpoint.interval=4", "--eval.enabled=false"]
    result = forge_subprocess("train", "presets/debug.toml", "--run-dir", str(run), *args)
    assert result.returncode == 0, result.stderr
    return run


@pytest.mark.parametrize(
    "change,named",
    [
        (list, "holds a JSON list"),
        (lambda state: {"step": 4}, "has no 'tokens_seen'"),
        (lambda state: {**state, "step": "four"}, "'step' is \"four\", not int"),
        (lambda state: {**state, "scheduler": [1]}, "'scheduler' is [1], not dict"),
        (lambda state: {**state, "tokens_seen": -3}, "'tokens_seen' is -3, not a count"),
    ],
)
def test_resume_names_a_train_state_of_the_wrong_shape(trained_run, tmp_path, change, named):
    """The file's checksum is made to match, as when the file was written so: only its content is wrong."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    step = run / "checkpoints" / "step_4"
    state = step / "train_state.json"
    state.write_text(json.dumps(change(json.loads(state.read_text()))))
    sums = json.loads((step / "checksums.json").read_text())
    (step / "checksums.json").write_text(json.dumps({**sums, "train_state.json": file_checksum(state)}))
    before = tree(run)
    assert_refused(run_forge("resume", str(run), "--train.max_steps=6"), str(state), named)
    assert tree(run) == before


@pytest.mark.parametrize(
    "task,named",
    [
        ("task: [unclosed\n  : :\n", "is not YAML"),
        ('task: nodata\noutput_type: loglikelihood\ndoc_to_text: "{{a}}"\n', "names no data set"),
        ("- task: one\n- task: two\n", "got list"),
    ],
)
def test_eval_names_a_task_file_it_cannot_build_a_task_from(trained_run, tmp_path, task, named):
    task_file = tmp_path / "task.yaml"
    task_file.write_text(task)
    before = tree(trained_run)
    assert_refused(run_forge("eval", str(trained_run), "--tasks", str(task_file)), f"task file {task_file}", named)
    assert tree(trained_run) == before


def to_dev_full(monkeypatch, module, name_part: str) -> None:
    """`module`'s open() of a file whose name holds `name_part` for writing opens /dev/full instead, where
    every write that reaches the disk fails with ENOSPC, as on a full disk."""
    real_open = open

    def full_open(path, mode="r", *args, **kwargs):
        wanted = "w" in mode or "a" in mode
        return real_open("/dev/full" if wanted and name_part in str(path) else path, mode, *args, **kwargs)

    monkeypatch.setattr(module, "open", full_open, raising=False)


def assert_disk_full(result, path: Path) -> None:
    """Exit code 1 (the machine's doing, as for a checkpoint that cannot be written), one line naming the
    file, no traceback."""
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    assert "Traceback" not in result.stdout + result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and said[0].startswith(f"error: no space left on the disk writing {path}:"), result.stderr


def test_a_full_disk_while_writing_metrics_stops_training_with_one_line(tmp_path, monkeypatch):
    from engine.metrics.trackers import JsonlSink

    opened = JsonlSink.__init__

    def on_full_disk(self, path, resumed_from):
        opened(self, path, resumed_from)
        self.file.close()
        self.file = open("/dev/full", "a", encoding="utf-8")  # noqa: SIM115 (the sink closes it)

    monkeypatch.setattr(JsonlSink, "__init__", on_full_disk)
    run = tmp_path / "run"
    args = [*TINY_RUN, "--train.max_steps=4", "--eval.enabled=false"]
    assert_disk_full(run_forge("train", "presets/debug.toml", "--run-dir", str(run), *args), run / "metrics.jsonl")
    ended = [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines()][-1]
    assert ended["event"] == "end" and ended["reason"] == "failed" and "no space left" in ended["error"]


def test_a_full_disk_while_tokenizing_stops_with_one_line(tmp_path, monkeypatch):
    import engine.durable

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text((REPO / "README.md").read_text()[:20000])
    to_dev_full(monkeypatch, engine.durable, ".npy.")  # a shard's temporary file
    out = tmp_path / "out"
    result = run_forge("tokenize", str(texts), "--train-tokenizer", "--vocab-size", "300", "--out", str(out))
    assert_disk_full(result, out / "shard-00000.npy")
    assert not list(out.glob("*.npy*"))


@pytest.mark.parametrize(
    "command",
    [
        ["tokenize", "TEXTS", "--train-tokenizer", "--vocab-size", "300", "--out", "OUT"],
        ["init", "OUT", "--defaults"],
        ["extract", "RUN", "--layers", "layers.0", "--text", "ROMEO: hello", "--out", "OUT"],
    ],
    ids=["tokenize", "init", "extract"],
)
@pytest.mark.parametrize("inside", [False, True], ids=["the-file", "under-the-file"])
def test_an_output_path_at_or_under_a_regular_file_is_refused(trained_run, tmp_path, command, inside):
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text((REPO / "README.md").read_text()[:5000])
    blocker = tmp_path / "blocker"
    blocker.write_text("mine\n")
    out = blocker / "out" if inside else blocker
    named = {"TEXTS": str(texts), "OUT": str(out), "RUN": str(trained_run)}
    before, run_before = tree(tmp_path), tree(trained_run)
    result = run_forge(*[named.get(arg, arg) for arg in command])
    if inside:
        assert_refused(result, str(out), f"is inside {blocker}, which is a file")
    elif command[0] == "init":
        assert_refused(result, str(out), "already exists")
    else:
        assert_refused(result, f"--out {out} is a file")
    assert tree(tmp_path) == before and tree(trained_run) == run_before


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_init_force_replaces_only_a_regular_file(tmp_path, kind):
    """Not tried on /dev/full itself: before the fix, the rename would have replaced the machine's device."""
    target = tmp_path / "preset.toml"
    kept = tmp_path / "kept.toml"
    kept.write_text("mine\n")
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to(kept)
    assert_refused(run_forge("init", str(target), "--defaults", "--force"), f"PRESET {target} is", "regular files")
    assert (target.is_fifo() if kind == "fifo" else target.is_symlink()) and kept.read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.toml", "preset.toml"]


@pytest.mark.parametrize(
    "command,named",
    [
        (["generate", "RUN", "--prompt", "ROMEO:", "--max-new-tokens", "4", "--temperature", "nan"], "--temperature nan"),
        (["generate", "RUN", "--prompt", "ROMEO:", "--max-new-tokens", "4", "--temperature", "inf"], "--temperature inf"),
        (["extract", "RUN", "--layers", "layers.0", "--text", "ROMEO:", "--out", "OUT", "--shard-mb", "nan"], "--shard-mb nan"),
        (["extract", "RUN", "--layers", "layers.0", "--text", "ROMEO:", "--out", "OUT", "--shard-mb", "inf"], "--shard-mb inf"),
    ],
)  # fmt: skip
def test_a_number_option_that_is_not_finite_is_refused(trained_run, tmp_path, command, named):
    named_paths = {"RUN": str(trained_run), "OUT": str(tmp_path / "out")}
    before = tree(trained_run)
    assert_refused(run_forge(*[named_paths.get(arg, arg) for arg in command]), named)
    assert tree(trained_run) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "override,limit",
    [
        ("--model.max_seq_len=1e12", "16777216"),
        ("--model.dim=1e9", "1048576"),
        ("--model.vocab_size=1e12", "16777216"),
        ("--train.batch_size=1e12", "1048576"),
    ],
)
def test_a_size_beyond_its_bound_is_refused_by_name_before_training(tmp_path, override, limit):
    """Sizes that validation took and the allocation then failed on."""
    run = tmp_path / "run"
    result = run_forge("train", "presets/debug.toml", *TINY_RUN, override, "--run-dir", str(run))
    assert_refused(result, override.split("=")[0].removeprefix("--"), f"less than or equal to {limit}")
    assert not run.exists()


@pytest.mark.parametrize(
    "override,limit",
    [
        ("--train.max_steps=1000000000000000000000000000000", "1000000000000"),
        ("--train.max_tokens=1000000000000000000000000000000", "1000000000000000000"),
    ],
)
def test_a_run_length_beyond_its_bound_is_refused_by_name(override, limit):
    """Checked by validate-config: before the bound, training took the length and went on for ever."""
    result = run_forge("validate-config", "presets/debug.toml", override)
    assert_refused(result, override.split("=")[0].removeprefix("--"), f"less than or equal to {limit}")
