"""`forge runs`: each run's status as it really ended (complete, SIGKILL, preemption, still running), and
`forge runs compare`: the configs that differ and curves drawn from the runs' own metrics."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.run_lock import RunLock, lock_holder
from engine.runs import attempt_records, config_differences, metric_records
from forgecli.app import app
from tests.conftest import REPO
from tests.helpers.runs import TINY, child_env

LONG = ["--train.max_steps=100000", "--checkpoint.interval=100000"]  # runs until a signal stops it


def forge_runs(*args: str):
    result = CliRunner().invoke(app, ["runs", *args], env={"NO_COLOR": "1", "COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result


def start_training(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "forgecli.app", "train", "presets/debug.toml", "--run-dir", str(run_dir), *TINY, *extra],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if any(r.get("step", 0) >= step and "loss" in r for r in metric_records(run_dir)):
            return
        time.sleep(0.01)
    raise AssertionError(f"{run_dir.name} ended before step {step}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A complete run and a preempted one (SIGTERM: emergency checkpoint, exit 75), trained side by side."""
    root = tmp_path_factory.mktemp("runs")
    complete = start_training(root / "complete", "--train.max_steps=6")
    preempted = start_training(root / "preempted", *LONG, "--optimizer.lr=1e-3")
    try:
        wait_for_step(preempted, root / "preempted", 4)
        preempted.send_signal(signal.SIGTERM)
        assert preempted.wait(timeout=120) == 75
        assert complete.wait(timeout=240) == 0
    finally:
        complete.kill()
        preempted.kill()
    return root


def statuses(root: Path) -> dict[str, dict]:
    return {run["name"]: run for run in json.loads(forge_runs(str(root), "--json").stdout)}


def test_each_run_shows_how_it_ended(runs):
    live = start_training(runs / "killed", *LONG)
    try:
        wait_for_step(live, runs / "killed", 2)
        seen = statuses(runs)
        table = forge_runs(str(runs)).stdout  # `forge runs DIR`: the same, as a table
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()
    assert {name: run["status"] for name, run in seen.items()} == {
        "complete": "complete",
        "preempted": "preempted",
        "killed": "running",
    }
    assert seen["killed"]["detail"] == f"pid {live.pid}"
    assert seen["complete"]["step"] == seen["complete"]["max_steps"] == seen["complete"]["last_checkpoint"] == 6
    assert seen["complete"]["tokens_seen"] == 6 * 4 * 64 and seen["complete"]["eval_loss"] is not None
    stopped = seen["preempted"]
    assert stopped["detail"] == f"SIGTERM at step {stopped['step']}" and stopped["last_checkpoint"] == stopped["step"]
    assert [r["event"] for r in attempt_records(runs / "preempted")] == ["start", "end"]
    rows = {line.split()[0]: line.split()[1] for line in table.splitlines()[1:] if line.strip()}
    assert rows == {"complete": "complete", "preempted": "preempted", "killed": "running"}

    after = statuses(runs)["killed"]  # SIGKILL: no end record, and the kernel has dropped the lock
    assert after["status"] == "failed" and after["detail"].startswith("killed")
    assert attempt_records(runs / "killed")[-1]["event"] == "start"


def test_a_run_whose_lock_is_held_is_running(tmp_path):
    """The lock, not the records, says a run is live: probing it (F_GETLK) neither takes nor disturbs it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text("[train]\nmax_steps = 10\n")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from engine.run_lock import RunLock; RunLock.acquire(Path(sys.argv[1])); "
            "print('locked', flush=True); time.sleep(60)",
            str(run_dir),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert lock_holder(run_dir) == holder.pid
        assert statuses(tmp_path)["run"]["status"] == "running"
    finally:
        holder.kill()
        holder.wait()
    assert lock_holder(run_dir) is None
    assert statuses(tmp_path)["run"]["status"] == "failed"  # never got to max_steps, and nothing says why
    RunLock.acquire(run_dir).release()  # the probe left nothing behind that would stop a new run


def test_compare_plots_the_runs_own_metrics(runs, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    saved: list[Figure] = []
    savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (saved.append(self), savefig(self, *a, **k))[1])
    png = tmp_path / "compare.png"
    result = forge_runs("compare", str(runs / "complete"), str(runs / "preempted"), "--plot", str(png), "--x", "tokens")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and len(saved) == 1
    assert "optimizer.lr" in result.stdout and "train.max_steps" in result.stdout  # the fields that differ
    assert "complete train" in result.stdout and "preempted eval" in result.stdout  # the terminal plot's legend

    panels = {axes.get_title(): {line.get_label(): line for line in axes.get_lines()} for axes in saved[0].axes}
    assert set(panels) == {"training loss", "eval loss", "learning rate", "tokens/s"}
    for name in ("complete", "preempted"):
        records = metric_records(runs / name)
        for title, key in (("training loss", "loss"), ("eval loss", "eval_loss"), ("learning rate", "lr")):
            line = panels[title][name]
            logged = [r for r in records if key in r]
            assert list(line.get_ydata()) == [r[key] for r in logged]
            assert list(line.get_xdata()) == [r["step"] * 4 * 64 for r in logged]  # --x tokens


def test_config_differences_name_only_the_fields_that_differ(runs):
    differences = config_differences([runs / "complete", runs / "preempted"])
    assert differences == {
        "optimizer.lr": [2e-3, 1e-3],
        "train.max_steps": [6, 100000],
        "checkpoint.interval": [4, 100000],
        "scheduler.decay_steps": [2, 99996],
    }


def test_listing_runs_does_not_load_torch(runs):
    """`forge runs` is typed often, in a hurry: it reads files and never imports torch."""
    code = (
        "import sys\nfrom forgecli.app import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "runs", str(runs), "--json"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert {run["name"] for run in json.loads(result.stdout)} >= {"complete", "preempted"}


def test_a_run_stopped_by_an_error_is_failed_with_that_error(tmp_path):
    run_dir = tmp_path / "diverged"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "forgecli.app",
            "train",
            "presets/debug.toml",
            "--run-dir",
            str(run_dir),
            *TINY,
            "--train.max_steps=30",
            "--optimizer.lr=1e12",
        ],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 1, result.stderr
    run = statuses(tmp_path)["diverged"]
    assert run["status"] == "failed" and run["detail"].startswith("TrainingDiverged: 5 bad steps in a row")
