"""LR schedules against their closed forms."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config.scheduler import SchedulerConfig
from engine.plan import check_config
from engine.train.schedules import build_scheduler, lr_multiplier


def test_warmup_starts_at_documented_value_and_reaches_peak():
    f = lr_multiplier(SchedulerConfig(name="cosine", warmup_steps=9, min_lr_ratio=0.1), max_steps=109)
    assert f(0) == pytest.approx(1 / 10)
    assert f(8) == pytest.approx(9 / 10)
    assert f(9) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "name,closed_form",
    [
        ("cosine", lambda p, m: m + (1 - m) * 0.5 * (1 + math.cos(math.pi * p))),
        ("linear", lambda p, m: 1 - (1 - m) * p),
        ("constant", lambda p, m: 1.0),
    ],
)
def test_decay_closed_forms(name, closed_form):
    warmup, total, floor = 10, 110, 0.2
    f = lr_multiplier(SchedulerConfig(name=name, warmup_steps=warmup, min_lr_ratio=floor), max_steps=total)
    for step in (10, 35, 60, 85, 109, 110, 500):
        progress = min((step - warmup) / (total - warmup - 1), 1.0)
        assert f(step) == pytest.approx(closed_form(progress, floor))


def test_explicit_decay_steps_then_floor():
    f = lr_multiplier(SchedulerConfig(name="linear", warmup_steps=0, decay_steps=50, min_lr_ratio=0.0), max_steps=200)
    assert f(25) == pytest.approx(0.5) and f(50) == 0.0 and f(199) == 0.0


def test_none_is_flat():
    f = lr_multiplier(SchedulerConfig(name="none"), max_steps=10)
    assert all(f(s) == 1.0 for s in range(10))


def test_scheduler_drives_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.5)
    sched = build_scheduler(opt, SchedulerConfig(name="cosine", warmup_steps=3, min_lr_ratio=0.0), max_steps=13)
    seen = []
    for _ in range(13):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[0] == pytest.approx(0.5 / 4) and seen[3] == pytest.approx(0.5)
    assert seen[-2] == pytest.approx(0.5 * 0.5 * (1 + math.cos(math.pi * 8 / 9)))
    assert seen[-1] == pytest.approx(0.0)  # the last step trains at the floor


# --- WSD and REX --------------------------------------------------------------------------------------

WSD_SHAPES = {
    "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
    "linear": lambda p: 1 - p,
    "sqrt": lambda p: 1 - math.sqrt(p),
}


@pytest.mark.parametrize("decay_type", sorted(WSD_SHAPES))
def test_wsd_phases_land_on_their_steps(decay_type):
    warmup, stable, decay, floor = 5, 20, 10, 0.1
    f = lr_multiplier(
        SchedulerConfig(
            name="wsd",
            warmup_steps=warmup,
            stable_steps=stable,
            decay_steps=decay,
            min_lr_ratio=floor,
            wsd_decay_type=decay_type,
        ),
        max_steps=100,
    )
    assert [f(s) for s in range(warmup)] == pytest.approx([(s + 1) / 6 for s in range(warmup)])
    assert all(f(s) == 1.0 for s in range(warmup, warmup + stable + 1))  # stable 5..24, decay starts at 1.0
    for s in range(warmup + stable, warmup + stable + decay + 1):
        p = (s - warmup - stable) / decay
        assert f(s) == pytest.approx(floor + (1 - floor) * WSD_SHAPES[decay_type](p))
    assert f(warmup + stable + 1) < 1.0
    assert f(warmup + stable + decay) == pytest.approx(floor) and f(99) == pytest.approx(floor)


def test_wsd_without_stable_steps_decays_to_the_last_step():
    f = lr_multiplier(
        SchedulerConfig(name="wsd", warmup_steps=4, wsd_decay_type="linear", min_lr_ratio=0.0), max_steps=25
    )
    assert f(4) == 1.0 and f(14) == pytest.approx(0.5) and f(24) == 0.0


@pytest.mark.parametrize("alpha", [1.0, 2.5])
def test_rex_closed_form(alpha):
    """Chen, Wolfe & Kyrillidis (2022): (1 - p) / (1/2 + (1 - p)/2), here to the power alpha."""
    warmup, total, floor = 10, 111, 0.05
    f = lr_multiplier(
        SchedulerConfig(name="rex", warmup_steps=warmup, min_lr_ratio=floor, rex_alpha=alpha), max_steps=total
    )
    for step, p in ((10, 0.0), (35, 0.25), (60, 0.5), (85, 0.75), (110, 1.0)):
        rex = ((1 - p) / (0.5 + 0.5 * (1 - p))) ** alpha
        assert f(step) == pytest.approx(floor + (1 - floor) * rex)
    assert f(60) == pytest.approx(floor + (1 - floor) * (2 / 3) ** alpha)


def test_learning_rate_includes_schedule_free_warmup_and_key_steps():
    from engine.config import load_job_config
    from engine.train.schedules import key_steps, learning_rate

    cfg = check_config(
        load_job_config(
            None,
            [
                "--optimizer.name=schedule_free_adamw",
                "--scheduler.name=constant",
                "--optimizer.lr=0.01",
                "--optimizer.schedule_free_warmup_steps=4",
                "--train.max_steps=20",
            ],
        ),
        1,
    )
    assert [learning_rate(cfg, s) for s in range(5)] == pytest.approx([0.0025, 0.005, 0.0075, 0.01, 0.01])
    assert key_steps(cfg) == [0, 3, 19]
    wsd = check_config(
        load_job_config(
            None,
            [
                "--scheduler.name=wsd",
                "--scheduler.warmup_steps=5",
                "--scheduler.stable_steps=20",
                "--scheduler.decay_steps=10",
                "--train.max_steps=100",
            ],
        ),
        1,
    )
    assert key_steps(wsd) == [0, 4, 5, 25, 35, 99]


def test_schedules_never_import_torch():
    import subprocess
    import sys

    code = "import sys, engine.train.schedules; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


# --- warm restarts and inv_sqrt ----------------------------------------------------------------------


def closed_cycle(name, local, length, warmup, floor):
    """One cycle's multiplier by its documented closed form (default decay: ends on the cycle's last step)."""
    if local < warmup:
        return (local + 1) / (warmup + 1)
    p = min((local - warmup) / max(length - warmup - 1, 1), 1.0)
    return {"cosine": floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)), "linear": 1 - (1 - floor) * p}[name]


@pytest.mark.parametrize("name", ["cosine", "linear"])
def test_equal_cycles_rewarm_and_decay_at_every_step(name):
    total, warmup, rewarmup, floor = 90, 6, 3, 0.1
    cfg = SchedulerConfig(name=name, warmup_steps=warmup, min_lr_ratio=floor, cycles=3, rewarmup_steps=rewarmup)
    f = lr_multiplier(cfg, max_steps=total)
    for step in range(total):
        k, local = divmod(step, 30)
        expected = closed_cycle(name, local, 30, warmup if k == 0 else rewarmup, floor)
        assert f(step) == pytest.approx(expected, abs=1e-12), step
    assert f(30) == pytest.approx(1 / 4) and f(29) == pytest.approx(floor) and f(89) == pytest.approx(floor)


def test_cycle_boundaries_and_rewarmup_defaulting_to_warmup():
    total, warmup, floor, bounds = 100, 4, 0.0, [10, 45]
    f = lr_multiplier(SchedulerConfig(name="cosine", warmup_steps=warmup, min_lr_ratio=floor, cycles=bounds), total)
    starts, ends = [0, 10, 45], [10, 45, 100]
    for step in range(total):
        k = sum(step >= s for s in starts) - 1
        expected = closed_cycle("cosine", step - starts[k], ends[k] - starts[k], warmup, floor)
        assert f(step) == pytest.approx(expected, abs=1e-12), step


def test_without_cycles_the_numbers_are_unchanged():
    """One cycle (or cycles unset) gives bitwise the schedule of before."""
    for name in ("cosine", "linear", "rex", "constant"):
        plain = lr_multiplier(SchedulerConfig(name=name, warmup_steps=7, min_lr_ratio=0.05), max_steps=123)
        one = lr_multiplier(SchedulerConfig(name=name, warmup_steps=7, min_lr_ratio=0.05, cycles=1), max_steps=123)
        for step in range(130):
            p = min((step - 7) / (123 - 7 - 1), 1.0)
            if step >= 7 and name == "cosine":
                assert plain(step) == 0.05 + (1 - 0.05) * (0.5 * (1 + math.cos(math.pi * p)))
            assert plain(step) == one(step)


def test_inv_sqrt_closed_form_at_every_step():
    warmup = 8
    f = lr_multiplier(SchedulerConfig(name="inv_sqrt", warmup_steps=warmup), max_steps=200)
    for step in range(200):
        expected = (step + 1) / (warmup + 1) if step < warmup else math.sqrt(warmup / max(step, warmup))
        assert f(step) == pytest.approx(expected, abs=1e-12), step
    nowarm = lr_multiplier(SchedulerConfig(name="inv_sqrt"), max_steps=50)
    assert [nowarm(s) for s in range(4)] == pytest.approx([1.0, math.sqrt(1 / 2), math.sqrt(1 / 3), 0.5])


def test_inv_sqrt_with_cycles_restarts_its_clock():
    f = lr_multiplier(SchedulerConfig(name="inv_sqrt", warmup_steps=4, cycles=[20], rewarmup_steps=2), 40)
    assert f(19) == pytest.approx(math.sqrt(4 / 19))
    assert [f(20), f(21), f(22), f(30)] == pytest.approx([1 / 3, 2 / 3, 1.0, math.sqrt(4 / 12)])


def test_cycles_are_validated():
    from engine.config import load_job_config
    from engine.errors import ConfigError

    for bad in ("[10,5]", "[0,10]", "0"):
        with pytest.raises(ConfigError, match=r"scheduler\.cycles"):
            load_job_config(None, [f"--scheduler.cycles={bad}"])
    with pytest.raises(ConfigError, match="rewarmup_steps"):
        load_job_config(None, ["--scheduler.rewarmup_steps=3"])
    with pytest.raises(ConfigError, match=r"scheduler\.cycles"):
        check_config(load_job_config(None, ["--scheduler.cycles=[50]", "--train.max_steps=50"]), 1)


def test_key_steps_mark_every_rewarmup():
    from engine.config import load_job_config
    from engine.train.schedules import key_steps

    cfg = check_config(
        load_job_config(
            None,
            [
                "--scheduler.warmup_steps=5",
                "--scheduler.cycles=[40, 70]",
                "--scheduler.rewarmup_steps=3",
                "--train.max_steps=100",
            ],
        ),
        1,
    )
    assert key_steps(cfg) == [0, 4, 5, 39, 40, 42, 43, 69, 70, 72, 73, 99]


def test_run_directory_pins_a_number_of_cycles_to_its_boundaries():
    from engine.config import load_job_config
    from engine.train.schedules import with_pinned_schedule

    cfg = check_config(load_job_config(None, ["--scheduler.cycles=3", "--train.max_steps=90"]), 1)
    pinned = with_pinned_schedule(cfg).scheduler
    assert pinned.cycles == [30, 60] and pinned.decay_steps is None
    longer = pinned.model_copy(update={"cycles": pinned.cycles})
    assert lr_multiplier(longer, 120)(45) == lr_multiplier(cfg.scheduler, 90)(45)


def test_none_has_no_rewarmup_either():
    with pytest.raises(ValueError, match="no warmup"):
        SchedulerConfig(name="none", cycles=2, rewarmup_steps=3)


def test_inv_sqrt_takes_no_decay_steps_and_the_run_directory_adds_none():
    from engine.config import load_job_config
    from engine.train.schedules import with_pinned_schedule

    with pytest.raises(ValueError, match="no decay_steps"):
        SchedulerConfig(name="inv_sqrt", decay_steps=10)
    cfg = check_config(load_job_config(None, ["--scheduler.name=inv_sqrt", "--scheduler.warmup_steps=4"]), 1)
    assert with_pinned_schedule(cfg).scheduler.decay_steps is None
