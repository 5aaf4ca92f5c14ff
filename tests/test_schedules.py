"""LR schedules against their closed forms."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config.scheduler import SchedulerConfig
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

    cfg = load_job_config(
        None,
        [
            "--optimizer.name=schedule_free_adamw",
            "--scheduler.name=constant",
            "--optimizer.lr=0.01",
            "--optimizer.schedule_free_warmup_steps=4",
            "--train.max_steps=20",
        ],
    ).validate(1)
    assert [learning_rate(cfg, s) for s in range(5)] == pytest.approx([0.0025, 0.005, 0.0075, 0.01, 0.01])
    assert key_steps(cfg) == [0, 3, 19]
    wsd = load_job_config(
        None,
        [
            "--scheduler.name=wsd",
            "--scheduler.warmup_steps=5",
            "--scheduler.stable_steps=20",
            "--scheduler.decay_steps=10",
            "--train.max_steps=100",
        ],
    ).validate(1)
    assert key_steps(wsd) == [0, 4, 5, 25, 35, 99]


def test_schedules_never_import_torch():
    import subprocess
    import sys

    code = "import sys, engine.train.schedules; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
