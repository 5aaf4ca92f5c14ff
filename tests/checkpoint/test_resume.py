"""Never lose a run: a run killed at any step resumes to exactly the uninterrupted result."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.checkpoint.dcp import latest_checkpoint
from engine.checkpoint.layout import COMPLETE, step_dirs
from engine.config import load_job_config
from engine.config.changes import resume_issues
from tests.conftest import REPO
from tests.helpers.runs import TINY, child_env, forge, losses, records


def train_args(run_dir: Path, *extra: str) -> list[str]:
    return ["train", "presets/debug.toml", "--run-dir", str(run_dir), *TINY, *extra]


def kill_after(run_dir: Path, step: int, *extra: str) -> int:
    """Start training, SIGKILL it as soon as `step` is logged; return the last step it logged."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "forgecli.app", *train_args(run_dir, "--train.max_steps=40", *extra)],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            logged = (
                [r["step"] for r in records(run_dir) if "loss" in r] if (run_dir / "metrics.jsonl").exists() else []
            )
            if logged and logged[-1] >= step:
                break
            time.sleep(0.005)
        assert proc.poll() is None, "training finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    return [r["step"] for r in records(run_dir) if "loss" in r][-1]


def final_weights(run_dir: Path, steps: int = 40) -> dict[str, torch.Tensor]:
    from engine.checkpoint.dcp import load_checkpoint
    from engine.config import load_job_config
    from engine.model.transformer import Transformer

    model = Transformer(load_job_config(run_dir / "config.toml").model)
    step, path = latest_checkpoint(run_dir / "checkpoints")
    assert step == steps
    load_checkpoint(path, model)
    return model.state_dict()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("resume") / "whole"
    result = forge(*train_args(run_dir, "--train.max_steps=40"))
    assert result.returncode == 0, result.stderr
    return run_dir


# A batch ramp from 4 to 16 sequences (one process, batch_size 4: 1 to 4 micro-batches a step) over 6000 tokens, a
# rise each 2000 tokens: 4 sequences a step in steps 1-8, 8 in steps 9-12, 12 in steps 13-15, 16 from step 16 on;
# the schedule in tokens. Killed between steps 5 and 15 and resumed from the checkpoint of step 4, 8 or 12: inside
# the ramp, where the checkpoint's step must give back both the data position and the tokens seen. 20 steps (the
# last override wins), to keep its bigger steps cheap.
BATCHING = {
    "accum1": [],
    "accum2": ["--train.grad_accum_steps=2"],
    "ramp": [
        "--train.global_batch_size=16",
        "--train.batch_ramp_start=4",
        "--train.batch_ramp_tokens=6000",
        "--scheduler.unit=tokens",
        "--scheduler.warmup_steps=3000",
        "--train.max_steps=20",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("batching,kills", [("accum1", 1), ("accum2", 2), ("ramp", 1)])
def test_killed_runs_resume_bitwise(tmp_path, uninterrupted, batching, kills):
    extra, steps = BATCHING[batching], 20 if batching == "ramp" else 40
    reference = uninterrupted
    if extra:  # accumulation or a ramp changes the computation, so it needs its own uninterrupted reference
        reference = tmp_path / "whole"
        assert forge(*train_args(reference, "--train.max_steps=40", *extra)).returncode == 0
    run_dir = tmp_path / "killed"
    rng = random.Random(f"{batching}{kills}")
    kill_steps = [rng.choice([s for s in range(5 + 12 * i, 16 + 12 * i) if s % 4]) for i in range(kills)]
    resumed_from = []
    for step in kill_steps:  # between checkpoints, and each attempt past a new checkpoint
        assert kill_after(run_dir, step, *extra) < steps
        resumed_from.append(latest_checkpoint(run_dir / "checkpoints")[0])
    assert resumed_from == sorted(set(resumed_from)) and len(resumed_from) == kills
    result = forge(*train_args(run_dir, "--train.max_steps=40", *extra))
    assert result.returncode == 0, result.stderr
    assert "resuming after step" in result.stdout
    assert sorted(losses(run_dir)) == list(range(1, steps + 1))
    assert losses(run_dir) == losses(reference)  # every step, bitwise: before the kill and after the resume
    ours, theirs = final_weights(run_dir, steps), final_weights(reference, steps)
    assert len(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    if batching == "ramp":  # the path it claims: steps of 4, 8, 12 and 16 sequences, the lr read in tokens
        seen = {r["step"]: (r["tokens_seen"], r["lr"]) for r in records(run_dir) if "loss" in r}
        assert [seen[s][0] - seen[s - 1][0] for s in (2, 9, 13, 16)] == [4 * 64, 8 * 64, 12 * 64, 16 * 64]
        assert seen == {r["step"]: (r["tokens_seen"], r["lr"]) for r in records(reference) if "loss" in r}


def test_resume_continues_and_refuses_unsafe_changes(tmp_path):
    run_dir = tmp_path / "run"
    assert forge(*train_args(run_dir, "--train.max_steps=4")).returncode == 0
    before = (run_dir / "metrics.jsonl").read_bytes()

    again = forge(*train_args(run_dir, "--train.max_steps=4"))
    assert again.returncode == 0 and "already complete at step 4" in again.stdout
    assert f"forge resume {run_dir} --train.max_steps=N (N > 4)" in again.stdout  # the command run below

    changed = forge(*train_args(run_dir, "--train.max_steps=6", "--model.dim=128", "--optimizer.lr=1.0"))
    assert changed.returncode == 2 and "model.dim" in changed.stderr and "optimizer.lr" in changed.stderr
    saved = load_job_config(run_dir / "config.toml")  # the refusal's fix points to forge resume
    assert (
        "forge resume RUN_DIR"
        in resume_issues(saved, load_job_config(run_dir / "config.toml", ["--model.dim=128"]))[0].hint
    )
    assert "Traceback" not in changed.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == before

    refused = forge("resume", str(run_dir), "--train.seq_len=32")
    assert refused.returncode == 2 and "train.seq_len" in refused.stderr

    extended = forge("resume", str(run_dir), "--train.max_steps=6")
    assert extended.returncode == 0, extended.stderr
    assert sorted(losses(run_dir)) == [1, 2, 3, 4, 5, 6]
    assert "max_steps = 6" in (run_dir / "config.toml").read_text()
    # The end line counts the whole run (both attempts), and says so rather than look like this attempt's time.
    assert "done: 6 steps" in extended.stdout and "of training (every attempt of the run)" in extended.stdout


def test_incomplete_newest_checkpoint_is_skipped(tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for run_dir in (whole, cut):
        assert forge(*train_args(run_dir, "--train.max_steps=8")).returncode == 0
    (cut / "checkpoints" / "step_8" / "COMPLETE").unlink()  # as if killed while saving step 8
    result = forge("resume", str(cut))
    assert result.returncode == 0, result.stderr
    assert "incomplete checkpoint" in result.stderr and "resuming after step 4" in result.stdout
    assert losses(cut) == losses(whole)


def test_resume_of_something_that_is_not_a_run(tmp_path):
    result = forge("resume", str(tmp_path))
    assert result.returncode == 2 and "not a Forge run directory" in result.stderr


def start(args: list[str], log: Path, script: str = "forgecli.app", env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", script, *args],
        cwd=REPO,
        env=env or child_env(),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if any(r.get("step", 0) >= step and "loss" in r for r in records(run_dir)):
            return
        time.sleep(0.005)
    raise AssertionError("training ended before the step to interrupt")


def saving(marker: Path) -> Path:
    """The checkpoint folder of the newest save tests.helpers.slow_saves announced."""
    return Path(marker.read_text().splitlines()[-1])


def assert_same_as(run_dir: Path, reference: Path) -> None:
    assert losses(run_dir) == losses(reference)
    ours, theirs = final_weights(run_dir), final_weights(reference)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_sigterm_saves_exits_for_requeue_and_resumes_exactly(tmp_path, uninterrupted):
    run_dir, log, marker = tmp_path / "preempted", tmp_path / "out.txt", tmp_path / "saves.txt"
    marker.touch()
    proc = start(
        train_args(run_dir, "--train.max_steps=40"),
        log,
        "tests.helpers.slow_saves",
        {**child_env(), "FORGE_TEST_SAVE_MARKER": str(marker)},
    )
    try:
        wait_for_step(proc, run_dir, 6)
        saves = len(marker.read_text().splitlines())
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while len(marker.read_text().splitlines()) == saves and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(marker.read_text().splitlines()) > saves, "the stop's save did not start"
        proc.send_signal(signal.SIGTERM)  # a second signal while it saves (the write waits 0.2 s) changes nothing
        # COMPLETE is written last and never removed from the newest checkpoint: missing now, the save was
        # unfinished when the signal was sent.
        assert not (saving(marker) / COMPLETE).exists(), "the second signal came after the save had finished"
        assert proc.wait(timeout=60) == 75, log.read_text()
    finally:
        proc.kill()
    stopped_at = [r["step"] for r in records(run_dir) if "loss" in r][-1]
    assert stopped_at < 40 and latest_checkpoint(run_dir / "checkpoints")[0] == stopped_at
    assert f"stopped by SIGTERM at step {stopped_at}" in log.read_text()
    assert f"forge resume {run_dir}" in log.read_text()
    result = forge("resume", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert_same_as(run_dir, uninterrupted)


def test_shutdown_watchdog_exits_and_the_run_still_resumes_exactly(tmp_path, uninterrupted):
    run_dir, log = tmp_path / "stuck", tmp_path / "out.txt"
    proc = start(train_args(run_dir, "--train.max_steps=40", "--train.shutdown_timeout_sec=0.001"), log)
    try:
        wait_for_step(proc, run_dir, 6)
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=60) == 76, log.read_text()
    finally:
        proc.kill()
    assert "shutdown took longer than train.shutdown_timeout_sec" in (run_dir / "train.log").read_text()
    result = forge("resume", str(run_dir), "--train.shutdown_timeout_sec=300")
    assert result.returncode == 0, result.stderr
    assert_same_as(run_dir, uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_killed_at_any_moment_even_mid_save_resumes_exactly(tmp_path, uninterrupted, mode):
    run_dir, marker = tmp_path / "crashy", tmp_path / "saves.txt"
    marker.touch()
    env = {**child_env(), "FORGE_TEST_SAVE_MARKER": str(marker)}
    args = train_args(run_dir, "--train.max_steps=40", f"--checkpoint.async_mode={mode}")
    rng = random.Random(mode)
    landed = []  # per attempt: whether the kill cut a save short, i.e. left the step_N it wrote incomplete
    for attempt in range(3):
        saves_before = len(marker.read_text().splitlines())
        target = saves_before + rng.choice([1, 2])
        proc = start(args, tmp_path / f"attempt{attempt}.txt", "tests.helpers.slow_saves", env)
        try:
            deadline = time.monotonic() + 240
            while len(marker.read_text().splitlines()) < target and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            assert proc.poll() is None, "training ended before the save to interrupt"
            # Inside the 0.2 s write, in the markers' fsync, or just after; the first attempt early in the write.
            time.sleep(rng.uniform(0.0, 0.1 if attempt == 0 else 0.35))
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        incomplete = {path for _, path in step_dirs(run_dir / "checkpoints") if not (path / COMPLETE).exists()}
        landed.append(saving(marker) in incomplete)
    assert any(landed), f"no kill landed inside a save: {landed}"
    result = forge(*args)
    assert result.returncode == 0, result.stderr
    assert_same_as(run_dir, uninterrupted)


def test_resume_with_every_checkpoint_damaged_is_a_clear_error_that_deletes_nothing(tmp_path, uninterrupted):
    import shutil

    run_dir = tmp_path / "damaged"
    shutil.copytree(uninterrupted, run_dir)
    for metadata in (run_dir / "checkpoints").glob("step_*/.metadata"):
        metadata.unlink()
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    result = forge("resume", str(run_dir), "--train.max_steps=44")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no readable checkpoint" in result.stderr and "nothing was deleted" in result.stderr
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
