"""Library callbacks (engine/train/callbacks/base.py): one registration puts a callback's metric in every sink
and console and its state in the checkpoint; a run killed at any point resumes it exactly; a failing callback
stops the run with a checkpoint, as a failing `[[train.hooks]]` hook does; checkpoints from before callbacks
kept state still resume into their W&B run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.checkpoint.dcp import latest_checkpoint
from engine.checkpoint.verify import file_checksum
from engine.train.callbacks import Callback
from engine.train.callbacks.dispatch import Callbacks
from tests.conftest import REPO
from tests.helpers.runs import TINY, child_env, records

TOY = [*TINY, "--metrics.enable_tensorboard=true", "--checkpoint.interval=4"]


def toy(run_dir: Path, *extra: str, steps: int = 12) -> subprocess.Popen:
    """Train (or resume) with tests/helpers/toy_callback.py's GradientRms and the plain console."""
    command = [sys.executable, "-m", "tests.helpers.toy_callback", str(run_dir), *extra, *TOY]
    return subprocess.Popen(
        [*command, f"--train.max_steps={steps}"],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def kind(run_dir: Path, key: str) -> list[dict]:
    """The records holding `key`, without their wall-clock time."""
    return [{k: v for k, v in r.items() if k != "time"} for r in records(run_dir) if key in r]


def saved_count(run_dir: Path) -> int:
    _, path = latest_checkpoint(run_dir / "checkpoints")
    return json.loads((path / "train_state.json").read_text())["callbacks"]["grad_rms"]["logged"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("toy") / "run"
    code, out, err = finished(toy(run_dir))
    assert code == 0, err
    return run_dir, out


def test_one_registration_reaches_metrics_tensorboard_console_and_checkpoint(uninterrupted):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, out = uninterrupted
    logged = kind(run_dir, "grad_rms")
    assert [(r["step"], r["grad_rms_logged"]) for r in logged] == [(3, 1), (6, 2), (9, 3), (12, 4)]
    assert all(r["grad_rms"] > 0 for r in logged)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("grad_rms")] == [
        (r["step"], pytest.approx(r["grad_rms"], rel=1e-7))
        for r in logged  # TensorBoard keeps float32
    ]
    shown = [line for line in out.splitlines() if line.startswith("grad_rms step")]
    assert shown == [
        f"grad_rms step {r['step']} grad_rms={r['grad_rms']:.4g} grad_rms_logged={r['step'] // 3}" for r in logged
    ]
    assert saved_count(run_dir) == 4


@pytest.mark.parametrize("kill_at", [5, 9])
def test_a_killed_run_resumes_the_callbacks_counter_and_metrics(tmp_path, uninterrupted, kill_at):
    """SIGKILL once step `kill_at` is logged (after checkpoint 4 or 8, before the next), then resume: the
    counter and every record (the step's, the callback's) equal the uninterrupted run's."""
    reference, _ = uninterrupted
    run_dir = tmp_path / "run"
    proc = toy(run_dir, steps=12)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if any("loss" in r and r["step"] >= kill_at for r in records(run_dir)):
                break
            time.sleep(0.005)
        assert proc.poll() is None, "training finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    assert max(r["step"] for r in records(run_dir)) < 12
    code, _, err = finished(toy(run_dir))
    assert code == 0, err
    assert saved_count(run_dir) == saved_count(reference) == 4
    assert kind(run_dir, "grad_rms") == kind(reference, "grad_rms")
    assert computed(run_dir) == computed(reference)


def computed(run_dir: Path) -> list[tuple]:
    """What a step's record holds that the computation decides (not its timing or the process's memory)."""
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"], r["tokens_seen"]) for r in kind(run_dir, "loss")]


def test_a_failing_callback_stops_the_run_with_a_checkpoint_and_it_resumes(tmp_path, uninterrupted):
    """GradientRms raises in after_step at step 5: every rank learns of it in step 6's sync, step 6 is
    completed, logged and saved, and the run stops naming the callback and its error (exit 1). Resumed without
    the fault, the run ends as the uninterrupted one."""
    reference, _ = uninterrupted
    run_dir = tmp_path / "run"
    code, _, err = finished(toy(run_dir, "--fail-at", "5"))
    assert code == 1, err
    assert "callback grad_rms failed in after_step at step 5: ValueError: the gradient statistic went wrong" in err
    assert f"the run stopped with its checkpoint {run_dir / 'checkpoints' / 'step_6'}" in err
    assert (run_dir / "checkpoints" / "step_6" / "COMPLETE").is_file()
    assert not (run_dir / "checkpoints" / "step_7").exists()
    code, _, err = finished(toy(run_dir))
    assert code == 0, err
    assert computed(run_dir) == computed(reference)
    assert kind(run_dir, "grad_rms") == kind(reference, "grad_rms")


def test_a_checkpoint_from_before_callback_state_resumes_into_its_wandb_run(tmp_path):
    """A train_state.json of the old shape (the W&B run id at the top level, no "callbacks"): the resumed run
    logs into that W&B run, and its own checkpoints keep the id as the W&B sink's state."""
    from engine.config import load_job_config
    from engine.train.run_dir import run_config
    from engine.train.trainer import train

    run_dir = tmp_path / "run"
    overrides = [arg.removeprefix("--") for arg in TINY] + ["metrics.enable_wandb=true", "train.max_steps=4"]
    train(load_job_config(REPO / "presets" / "debug.toml", overrides), run_dir)
    _, path = latest_checkpoint(run_dir / "checkpoints")
    state = json.loads((path / "train_state.json").read_text())
    first_id = state["callbacks"].pop("wandb")["run_id"]
    old = {k: v for k, v in state.items() if k != "callbacks"} | {"wandb_run_id": first_id}
    (path / "train_state.json").write_text(json.dumps(old))
    sums = json.loads((path / "checksums.json").read_text())
    sums["train_state.json"] = file_checksum(path / "train_state.json")
    (path / "checksums.json").write_text(json.dumps(sums))

    train(run_config(run_dir, ["train.max_steps=6"]), run_dir)
    _, path = latest_checkpoint(run_dir / "checkpoints")
    resumed = json.loads((path / "train_state.json").read_text())
    assert resumed["callbacks"]["wandb"] == {"run_id": first_id} and "wandb_run_id" not in resumed


class Marks(Callback):
    def __init__(self, name: str, priority: int, seen: list) -> None:
        self.name, self.priority, self.seen = name, priority, seen

    def before_step(self, step, loop) -> None:
        self.seen.append(self.name)


def test_callbacks_run_by_priority_then_in_the_order_given():
    import torch

    seen: list[str] = []
    given = [Marks("a", 0, seen), Marks("b", 5, seen), Marks("c", 0, seen), Marks("d", -1, seen)]
    Callbacks(given, True, torch.device("cpu")).emit("before_step", 1, 1, None)
    assert seen == ["b", "a", "c", "d"]
    with pytest.raises(ValueError, match="two callbacks are named a"):
        Callbacks([Marks("a", 0, seen), Marks("a", 1, seen)], True, torch.device("cpu"))
