"""Checkpoint policy and verified checkpoints: saves by wall time agreed across ranks, keep rules that rotation
never deletes (even when a deletion is killed), checksums that catch bytes damaged on disk, and a full disk."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.checkpoint import dcp
from engine.checkpoint.dcp import complete_checkpoints, load_checkpoint, save_checkpoint
from engine.checkpoint.manager import Checkpointer, CheckpointWriteError
from engine.checkpoint.verify import CHECKSUMS, verify_checkpoint
from engine.config.checkpoint import CheckpointConfig
from tests.conftest import REPO
from tests.helpers.checkpoints import trained_pair
from tests.helpers.runs import TINY, child_env, forge, losses

CPU = torch.device("cpu")


def saved_steps(root: Path) -> list[int]:
    return [step for step, _ in complete_checkpoints(root)]


def save_steps(ckpt: Checkpointer, steps: range) -> None:
    model, optimizer = trained_pair(0)
    for step in steps:
        ckpt.save(step, model, optimizer, {"step": step})
        ckpt.wait()


@pytest.mark.parametrize(
    "last,keep,survivors",
    [
        (20, [{"every": 4}], [4, 8, 12, 16, 20]),
        (19, [{"every": 4}], [4, 8, 12, 16, 19]),
        (20, [{"every": 4, "until": 8}], [4, 8, 20]),
        (20, [{"every": 10}, {"every": 3, "until": 7}], [3, 6, 10, 20]),
    ],
)
def test_keep_rules_survive_rotation_with_the_newest(tmp_path, last, keep, survivors):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(keep_last_n=1, keep=keep), CPU)
    save_steps(ckpt, range(1, last + 1))
    assert saved_steps(tmp_path) == survivors
    assert [step for step, _ in dcp.step_dirs(tmp_path)] == survivors, "nothing half-deleted is left"


def test_keep_rules_need_keep_last_n():
    with pytest.raises(ValueError, match="keep_last_n"):
        CheckpointConfig(keep=[{"every": 4}])


def test_the_clock_saves_when_interval_minutes_have_passed(tmp_path, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(Checkpointer, "clock", staticmethod(lambda: now[0]))
    ckpt = Checkpointer(tmp_path, CheckpointConfig(interval=10, interval_minutes=1.0), CPU)
    model, optimizer = trained_pair(0)
    due = []
    for step in range(1, 13):
        now[0] += 25.0  # each step takes 25 s: 60 s pass during step 3, then 3 steps after each save
        if ckpt.due(step, 12):
            due.append(step)
            ckpt.save(step, model, optimizer, {"step": step})
    assert due == [3, 6, 9, 10, 12]  # by time, and by step (10) and at the end, whichever comes first
    assert saved_steps(tmp_path) == due


TIMED_SCRIPT = """
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from engine.checkpoint.manager import Checkpointer
from engine.config.checkpoint import CheckpointConfig
from tests.helpers.checkpoints import trained_pair

dist.init_process_group("gloo")
root, rank = Path(sys.argv[1]), dist.get_rank()
now = [0.0]
if rank == 0:  # only rank 0's clock moves (25 s a step); rank 1's stands still and would never save alone
    Checkpointer.clock = staticmethod(lambda: now[0])
else:
    Checkpointer.clock = staticmethod(lambda: 0.0)
ckpt = Checkpointer(root, CheckpointConfig(interval_minutes=1.0), torch.device("cpu"))
model, optimizer = trained_pair(0)
due = []
for step in range(1, 11):
    now[0] += 25.0
    if ckpt.due(step, 100):
        due.append(step)
        ckpt.save(step, model, optimizer, {"step": step})
(root.parent / f"due_rank{rank}").write_text(" ".join(map(str, due)))
dist.barrier()
dist.destroy_process_group()
from engine.parallel.launch import end_process
end_process(0)
"""


def test_time_based_saves_happen_at_the_same_step_on_every_rank(tmp_path):
    from tests.helpers.torchrun import torchrun

    script = tmp_path / "timed.py"
    script.write_text(TIMED_SCRIPT)
    result = torchrun(script, 2, str(tmp_path / "ckpt"), timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    due = [(tmp_path / f"due_rank{rank}").read_text() for rank in range(2)]
    assert due == ["3 6 9", "3 6 9"]
    assert saved_steps(tmp_path / "ckpt") == [3, 6, 9]
    folder = tmp_path / "ckpt" / "step_9"
    assert {p.name for p in folder.iterdir()} - {"COMPLETE"} == {
        *json.loads((folder / CHECKSUMS).read_text()),
        CHECKSUMS,
    }
    assert any(p.name.startswith("__1_") for p in folder.iterdir()), "rank 1's own shards are summed too"
    assert verify_checkpoint(folder)


KILLED_PRUNE = """
import os, shutil, signal, sys
from pathlib import Path

from engine.checkpoint import dcp
from engine.config.checkpoint import CheckpointConfig

root, removed = Path(sys.argv[1]), []


def killed_midway(path, *args, **kwargs):
    # Deleting the first victim: one shard goes, then the process is SIGKILLed.
    os.unlink(sorted(path.glob("*.distcp"))[0])
    os.kill(os.getpid(), signal.SIGKILL)


dcp.shutil.rmtree = killed_midway
cfg = CheckpointConfig(keep_last_n=1, keep=[{"every": 4}])
dcp.prune_checkpoints(root, cfg.keep_last_n, 8, cfg.kept)
"""


def test_a_deletion_killed_midway_loses_nothing_that_should_survive(tmp_path):
    root = tmp_path / "ckpt"
    save_steps(Checkpointer(root, CheckpointConfig(), CPU), range(1, 9))
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_PRUNE, str(root)], cwd=REPO, env=child_env(), capture_output=True, timeout=120
    )
    assert killed.returncode == -9, killed.stderr
    assert not (root / "step_1" / "COMPLETE").exists(), "the victim lost its marker before any of its files"
    assert saved_steps(root) == [2, 3, 4, 5, 6, 7, 8]  # the kill came before the others were touched
    for step in (4, 8):  # what the rules keep: whole, and loadable
        assert verify_checkpoint(root / f"step_{step}")
        model, optimizer = trained_pair(1)
        assert load_checkpoint(root / f"step_{step}", model, optimizer) == {"step": step}
    Checkpointer(root, CheckpointConfig(keep_last_n=1, keep=[{"every": 4}]), CPU).prune(8)  # the next save's prune
    assert [step for step, _ in dcp.step_dirs(root)] == [4, 8]


def damage_middle(path: Path) -> None:
    """Overwrite 64 bytes in the middle of a file: its size stays, so only a checksum can tell."""
    size = path.stat().st_size
    with open(path, "r+b") as file:
        file.seek(size // 2)
        original = file.read(64)
        file.seek(size // 2)
        file.write(bytes(b ^ 0xFF for b in original))


def test_bytes_damaged_in_a_shard_are_caught_and_the_previous_checkpoint_loads(tmp_path):
    model, optimizer = trained_pair(0)
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, optimizer, {"step": step})
    shard = max((tmp_path / "step_2").glob("*.distcp"), key=lambda p: p.stat().st_size)
    damage_middle(shard)
    with pytest.raises(ValueError, match=shard.name):
        verify_checkpoint(tmp_path / "step_2")
    path, state = Checkpointer(tmp_path, CheckpointConfig(), CPU).restore(*trained_pair(1))
    assert path == tmp_path / "step_1" and state == {"step": 1}


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_every_file_has_a_checksum_whether_saved_in_the_loop_or_in_the_background(tmp_path, mode):
    save_steps(Checkpointer(tmp_path, CheckpointConfig(async_mode=mode), CPU), range(1, 2))
    folder = tmp_path / "step_1"
    files = {p.name for p in folder.iterdir()} - {"COMPLETE", CHECKSUMS}
    assert files == set(json.loads((folder / CHECKSUMS).read_text()))
    assert verify_checkpoint(folder)


@pytest.mark.slow
def test_a_damaged_shard_is_named_on_resume_which_continues_bitwise_from_the_one_before(tmp_path):
    args = ["presets/debug.toml", *TINY, "--checkpoint.keep_last_n=5"]
    whole, run = tmp_path / "whole", tmp_path / "run"
    assert forge("train", *args, "--run-dir", str(whole), "--train.max_steps=12").returncode == 0
    assert forge("train", *args, "--run-dir", str(run), "--train.max_steps=12").returncode == 0
    shutil.rmtree(run / "checkpoints" / "step_12")  # as if the run had stopped after step 8's checkpoint
    assert forge("checkpoint", "verify", str(run)).returncode == 0
    shard = max((run / "checkpoints" / "step_8").glob("*.distcp"), key=lambda p: p.stat().st_size)
    damage_middle(shard)
    verified = forge("checkpoint", "verify", str(run))
    assert verified.returncode == 1 and shard.name in verified.stdout and "damaged" in verified.stdout
    resumed = forge("resume", str(run), "--train.max_steps=12")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after step 4" in resumed.stdout
    assert shard.name in resumed.stdout + resumed.stderr  # the warning names the damaged file
    assert losses(run) == losses(whole)


def fill_disk(monkeypatch) -> None:
    """What a full disk does to a write, without one: the shard writer fails with ENOSPC."""

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(dcp, "record_rank_checksums", no_space)


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_full_disk_removes_the_partial_checkpoint_and_says_what_one_needs(tmp_path, monkeypatch, mode):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(async_mode=mode), CPU)
    save_steps(ckpt, range(1, 2))
    fill_disk(monkeypatch)
    with pytest.raises(CheckpointWriteError, match=r"disk is full: the checkpoint of step 2 needs about [\d.]+ MiB"):
        save_steps(ckpt, range(2, 3))
    assert [step for step, _ in dcp.step_dirs(tmp_path)] == [1]


FULL_DISK_SIZE = "12M"  # one checkpoint of the TINY model (7.5 MiB) fits, a second does not


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_real_full_disk_is_one_message_without_tracebacks(tmp_path, mode):
    disk = tmp_path / "disk"
    disk.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FULL_DISK_SIZE}", "tmpfs", disk]).returncode
    ):
        pytest.skip("mounting a small tmpfs needs root")
    try:
        result = forge(
            "train",
            "presets/debug.toml",
            *TINY,
            "--run-dir",
            str(tmp_path / "run"),
            "--train.max_steps=8",
            f"--checkpoint.dir={disk / 'ckpt'}",
            f"--checkpoint.async_mode={mode}",
        )
        assert result.returncode == 1
        assert "Traceback" not in result.stderr and "Exception in thread" not in result.stderr
        assert "disk is full: the checkpoint of step 8 needs about" in " ".join(result.stderr.split())
        assert [step for step, _ in dcp.step_dirs(disk / "ckpt")] == [4]
        assert verify_checkpoint(disk / "ckpt" / "step_4")
    finally:
        subprocess.run(["umount", disk], check=True)


@pytest.mark.parametrize("optimizer", ["adamw", "lion"])
def test_the_estimated_checkpoint_size_matches_a_saved_checkpoint(tmp_path, optimizer):
    from engine.config.loader import load_job_config
    from engine.model.transformer import Transformer
    from engine.parallel.memory import checkpoint_bytes
    from engine.train.losses import cross_entropy
    from engine.train.optim import build_optimizer

    cfg = load_job_config(REPO / "presets/debug.toml", [*TINY, f"--optimizer.name={optimizer}"])
    model = Transformer(cfg.model)
    opt = build_optimizer(model, cfg.optimizer)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
    cross_entropy(model(tokens), tokens).backward()
    opt.step()
    path = save_checkpoint(tmp_path, 1, model, opt, {"step": 1})
    on_disk = sum(file.stat().st_size for file in path.iterdir())
    assert 0.95 * on_disk < checkpoint_bytes(cfg) <= on_disk


def test_validate_config_says_how_much_disk_a_checkpoint_needs():
    from engine.config.loader import load_job_config
    from engine.parallel.memory import checkpoint_bytes

    size = checkpoint_bytes(load_job_config(REPO / "presets/debug.toml", TINY))
    shown = forge("validate-config", "presets/debug.toml", *TINY, "--checkpoint.keep_last_n=3")
    assert shown.returncode == 0, shown.stderr
    assert f"checkpoint size: {size / 2**20:.1f} MiB each" in " ".join(shown.stdout.split())
    assert f"keep_last_n=3 holds {3 * size / 2**20:.1f} MiB" in " ".join(shown.stdout.split())
    as_json = forge("validate-config", "presets/debug.toml", *TINY, "--json")
    assert json.loads(as_json.stdout)["memory"]["checkpoint_bytes"] == size


def test_the_policy_reads_from_a_preset_and_may_change_on_resume(tmp_path):
    from engine.config.changes import resume_issues
    from engine.config.loader import load_job_config

    preset = tmp_path / "p.toml"
    policy = "[checkpoint]\ninterval_minutes = 30\nkeep = [{every = 4, until = 20}, {every = 100}]\n"
    preset.write_text((REPO / "presets/debug.toml").read_text().replace("[checkpoint]\n", policy))
    cfg = load_job_config(preset)
    assert cfg.checkpoint.interval_minutes == 30
    assert [cfg.checkpoint.kept(step) for step in (8, 6, 20, 24, 300, 302)] == [True, False, True, False, True, False]
    changed = load_job_config(preset, ["--checkpoint.interval_minutes=5", "--checkpoint.keep_last_n=9"])
    assert resume_issues(cfg, changed) == []
    assert resume_issues(cfg, load_job_config(preset, ["--optimizer.lr=1"]))  # the check itself works


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_async_saves_sum_their_files_off_the_training_thread(tmp_path, monkeypatch, mode):
    import threading

    summed_in = []
    record = dcp.record_rank_checksums

    def recording(path, rank):
        summed_in.append(threading.current_thread())
        record(path, rank)

    monkeypatch.setattr(dcp, "record_rank_checksums", recording)
    save_steps(Checkpointer(tmp_path, CheckpointConfig(async_mode=mode), CPU), range(1, 2))
    assert summed_in and threading.main_thread() not in summed_in
    assert verify_checkpoint(tmp_path / "step_1")


def test_the_training_loop_saves_by_the_clock(tmp_path, monkeypatch):
    from engine.train.callbacks import Callback
    from tests.helpers.trainer import run

    now = [0.0]
    monkeypatch.setattr(Checkpointer, "clock", staticmethod(lambda: now[0]))

    class SlowSteps(Callback):  # every step takes 25 s by the checkpointer's clock
        def before_step(self, step, loop):
            now[0] += 25.0

    run(
        tmp_path,
        "timed",
        "train.max_steps=10",
        "checkpoint.interval_minutes=1",
        "checkpoint.keep_last_n=20",
        callbacks=[SlowSteps()],
    )
    assert saved_steps(tmp_path / "timed" / "checkpoints") == [3, 6, 9, 10]
