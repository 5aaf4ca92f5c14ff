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


@pytest.mark.parametrize("name,closed_form", [
    ("cosine", lambda p, m: m + (1 - m) * 0.5 * (1 + math.cos(math.pi * p))),
    ("linear", lambda p, m: 1 - (1 - m) * p),
    ("constant", lambda p, m: 1.0),
])
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
