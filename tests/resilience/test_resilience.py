"""Bad-step detection, the preemption signal handler and its watchdog, the collective health check."""

from __future__ import annotations

import json
import math
import os
import signal
import time

import pytest

from engine.config.train import TrainConfig
from engine.resilience.anomaly import StepGuard, TrainingDiverged
from engine.resilience.signals import SHUTDOWN_TIMEOUT_EXIT, StopRequest
from tests.helpers.torchrun import torchrun


def guard(**fields) -> StepGuard:
    return StepGuard(TrainConfig(**fields))


def test_non_finite_steps_are_problems_unless_the_grad_scaler_owns_them():
    g = guard()
    assert "non-finite loss" in g.problem(math.nan, 1.0)
    assert "non-finite loss" in g.problem(math.inf, 1.0)
    assert "non-finite gradient norm" in g.problem(2.0, math.inf)
    assert g.problem(2.0, math.inf, scaler_handles_overflow=True) is None  # fp16: the scaler skips and rescales
    assert g.problem(2.0, 1.0) is None


def test_spike_rule_waits_for_half_a_window_then_uses_mean_plus_sigma_std():
    g = guard(spike_window=8, spike_sigma=3.0)
    losses = [4.0, 4.2, 3.8, 4.1]
    for _i, loss in enumerate(losses[:3]):
        assert g.problem(100.0, 1.0) is None, "fewer than half a window: never a spike"
        g.accept(loss)
    g.accept(losses[3])
    mean = sum(losses) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in losses) / 4)
    assert g.problem(mean + 3.0 * std - 1e-9, 1.0) is None
    assert "loss spike" in g.problem(mean + 3.0 * std + 1e-6, 1.0)
    assert guard(spike_window=8, spike_sigma=0.0).problem(1e9, 1.0) is None  # 0 = off


def test_rollback_after_max_bad_steps_and_stop_after_max_rollbacks():
    g = guard(max_bad_steps=3, max_rollbacks=1)
    assert [g.reject() for _ in range(3)] == [False, False, True]
    g.rolled_back("3 bad steps in a row", {"guard": {"history": [2.0, 2.5]}})
    assert g.metrics() == {"skipped_steps": 3, "rollbacks": 1} and g.consecutive_bad == 0
    assert list(g.history) == [2.0, 2.5], "the loss history is the restored checkpoint's"
    g.reject()
    g.accept(1.0)  # a good step resets the run of bad ones
    assert [g.reject() for _ in range(3)] == [False, False, True]
    with pytest.raises(TrainingDiverged, match=r"3 bad steps in a row after 1 rollback.*max_rollbacks = 1"):
        g.rolled_back("3 bad steps in a row", None)


def test_guard_state_round_trips_through_json():
    g = guard(spike_window=4)
    for loss in (3.0, 2.5, 2.25):
        g.accept(loss)
    g.reject()
    restored = guard(spike_window=4)
    restored.load_state_dict(json.loads(json.dumps(g.state_dict())))
    assert restored.state_dict() == g.state_dict()
    assert restored.problem(9.0, 1.0) == g.problem(9.0, 1.0)


def test_signal_sets_the_flag_and_a_second_one_is_ignored():
    stop = StopRequest(shutdown_timeout_sec=60)
    before = signal.getsignal(signal.SIGTERM)
    with stop.installed():
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert stop.requested and stop.signal_name == "SIGUSR1"
        watchdog = stop.watchdog
        os.kill(os.getpid(), signal.SIGTERM)  # while "saving": recorded nowhere, interrupts nothing
        time.sleep(0.05)
        assert stop.signal_name == "SIGUSR1" and stop.watchdog is watchdog
    assert signal.getsignal(signal.SIGTERM) is before
    assert not watchdog.is_alive(), "leaving the block disarms the watchdog"


def test_watchdog_forces_exit_when_shutdown_takes_too_long():
    exits: list[int] = []
    stop = StopRequest(shutdown_timeout_sec=0.05, force_exit=exits.append)
    with stop.installed():
        stop.handle(signal.SIGTERM)
        deadline = time.monotonic() + 10  # the watchdog's thread may be scheduled late on a busy machine
        while not exits and time.monotonic() < deadline:
            time.sleep(0.01)
    assert exits == [SHUTDOWN_TIMEOUT_EXIT]


HEALTH_SCRIPT = """
import sys, time, torch, torch.distributed as dist
from pathlib import Path
from engine.parallel.launch import end_process
from engine.resilience.health import CollectiveTimeout, check_collectives
dist.init_process_group("gloo")
rank, out = dist.get_rank(), Path(sys.argv[1])
monitor = dist.new_group(backend="gloo")
check_collectives(5.0, torch.device("cpu"), monitor)  # healthy: passes on both ranks
(out / f"healthy_rank{rank}").touch()
if rank == 1:
    time.sleep(6)  # a hung rank: misses the next check
    end_process(0)
try:
    check_collectives(1.0, torch.device("cpu"), monitor)
except CollectiveTimeout as err:
    (out / "stopped").write_text(str(err))
    end_process(3)
end_process(0)
"""


def test_health_check_passes_then_names_the_rank_when_one_hangs(tmp_path):
    script = tmp_path / "health.py"
    script.write_text(HEALTH_SCRIPT)
    result = torchrun(script, 2, str(tmp_path), timeout=120)
    assert (tmp_path / "healthy_rank0").exists() and (tmp_path / "healthy_rank1").exists(), result.stdout[-3000:]
    assert (tmp_path / "stopped").exists(), result.stdout[-3000:]
    stopped = (tmp_path / "stopped").read_text()
    assert stopped.startswith("rank 0:"), stopped
    assert "Ranks 1 failed to pass monitoredBarrier" in stopped, "rank 0 names the rank that hung"
    assert result.returncode != 0, "the rank that saw the timeout exits with its error code"


# --- the training loop under injected faults ----------------------------------------------------------------

from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from engine.checkpoint.dcp import complete_checkpoints, load_checkpoint  # noqa: E402
from engine.config import load_job_config  # noqa: E402
from engine.model.transformer import Transformer  # noqa: E402
from engine.train.trainer import train  # noqa: E402
from tests.helpers.faults import Faults  # noqa: E402

TINY = [
    "train.loss_fn=cross_entropy",  # the faults reach the loss through the head's forward, which the chunked loss skips
    "model.dim=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=2",
    "train.seq_len=32",
    "model.max_seq_len=32",
    "train.batch_size=2",
    "metrics.log_interval=1",
    "eval.enabled=false",
    "scheduler.warmup_steps=1",
    "train.spike_window=6",
    "checkpoint.interval=4",
    "checkpoint.keep_last_n=10",
]


def faulty_run(tmp_path: Path, faults: Faults, *overrides: str) -> tuple[dict, list[dict]]:
    cfg = load_job_config(Path(__file__).parents[2] / "presets" / "debug.toml", [*TINY, *overrides])
    summary = train(cfg, tmp_path / "run", callbacks=[faults])
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return summary, [r for r in map(json.loads, lines) if "loss" in r]


def checkpoints_are_finite(root: Path) -> list[int]:
    steps = []
    for step, path in complete_checkpoints(root):
        model = Transformer(load_job_config(root.parent / "config.toml").model)
        load_checkpoint(path, model)
        assert all(torch.isfinite(p).all() for p in model.parameters()), path
        steps.append(step)
    return steps


class Snapshots(Faults):
    """Faults, plus a copy of the weights and the optimizer state as each step starts."""

    def __init__(self, **faults) -> None:
        super().__init__(**faults)
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def before_step(self, step, loop) -> None:
        super().before_step(step, loop)
        optimizer = loop.job.optimizer.state_dict()["state"]
        self.states[step] = {
            **{f"model.{k}": v.detach().clone() for k, v in loop.job.model.state_dict().items()},
            **{f"optimizer.{i}.{k}": v.clone() for i, state in optimizer.items() for k, v in state.items()},
        }


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors are not bitwise equal (or exist on one side only)."""
    return sorted(
        k
        for k in before.keys() | after.keys()
        if k not in before or k not in after or not torch.equal(before[k], after[k])
    )


def test_nan_gradient_and_loss_spike_are_skipped_without_touching_weights(tmp_path):
    hooks = Snapshots(nan_grad_steps=[6], spike_steps=[9])
    summary, records = faulty_run(tmp_path, hooks, "train.max_steps=12")
    states = hooks.states
    assert any(k.endswith(".exp_avg") for k in states[6]), "AdamW has moments to compare"
    assert changed(states[6], states[7]) == [] and changed(states[9], states[10]) == []  # skipped: nothing moves
    assert changed(states[5], states[6]) == changed(states[8], states[9]) == sorted(states[6])  # a good step: all
    assert summary["skipped_steps"] == 2 and summary["rollbacks"] == 0
    by_step = {r["step"]: r for r in records}
    assert by_step[6]["grad_norm"] is None and by_step[6]["skipped_steps"] == 1  # NaN is written as null
    assert by_step[9]["loss"] > by_step[8]["loss"] + 1 and by_step[9]["skipped_steps"] == 2
    assert by_step[12]["skipped_steps"] == 2 and math.isfinite(by_step[12]["loss"])
    log = (tmp_path / "run" / "train.log").read_text()
    assert "step 6 skipped: non-finite gradient norm" in log and "step 9 skipped: loss spike" in log
    assert checkpoints_are_finite(tmp_path / "run" / "checkpoints") == [4, 8, 12]


def test_consecutive_bad_steps_roll_back_to_the_last_checkpoint_and_the_run_completes(tmp_path):
    seen = {}

    class Watch(Faults):
        def before_step(self, step, loop):
            super().before_step(step, loop)
            seen[step] = loop.job.model.norm.weight.detach().clone()

    summary, records = faulty_run(tmp_path, Watch(nan_grad_steps=[6, 7]), "train.max_steps=10", "train.max_bad_steps=2")
    assert summary["skipped_steps"] == 2 and summary["rollbacks"] == 1 and summary["steps"] == 10
    restored = Transformer(load_job_config(tmp_path / "run" / "config.toml").model)
    load_checkpoint(tmp_path / "run" / "checkpoints" / "step_4", restored)
    assert torch.equal(seen[8], restored.norm.weight), "step 8 starts from the weights of checkpoint 4"
    assert not torch.equal(seen[6], restored.norm.weight)
    lrs = [r["lr"] for r in records[1:]]  # after the 1-step warmup the cosine only falls: the schedule kept its place
    assert lrs == sorted(lrs, reverse=True) and lrs[0] > lrs[-1]
    assert records[-1]["rollbacks"] == 1 and "rolled back to" in (tmp_path / "run" / "train.log").read_text()


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    summary, _ = faulty_run(tmp_path, Faults(nan_weight_steps=[8]), "train.max_steps=10")
    assert summary["rollbacks"] == 1
    # step 8's checkpoint is written after the rollback, with step 4's weights
    assert checkpoints_are_finite(tmp_path / "run" / "checkpoints") == [4, 8, 10]
    assert "non-finite weights; rolling back instead of saving them" in (tmp_path / "run" / "train.log").read_text()


def test_a_run_that_keeps_diverging_stops_with_a_clear_message(tmp_path):
    with pytest.raises(TrainingDiverged, match="after 1 rollback"):
        faulty_run(
            tmp_path,
            Faults(nan_grad_steps=range(6, 40)),
            "train.max_steps=40",
            "train.max_bad_steps=2",
            "train.max_rollbacks=1",
        )
    # step 8 came during a run of bad steps: its checkpoint would only have repeated step 4's weights
    assert checkpoints_are_finite(tmp_path / "run" / "checkpoints") == [4]
    with pytest.raises(TrainingDiverged, match="before the first checkpoint"):
        faulty_run(tmp_path / "early", Faults(nan_grad_steps=[1, 2]), "train.max_steps=4", "train.max_bad_steps=2")
