"""The live dashboard in a real terminal 80 columns wide (a tmux pane, captured): an MoE run under a batch ramp
shows every metric whole (lr, tokens/s, the expert imbalance and its one-line meaning, the ramp's batch), no
line is longer than the terminal, and the ETA is a time from the first logged steps on."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.helpers.runs import TINY

WIDTH = 80


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux for a real terminal")
def test_the_dashboard_fits_80_columns_and_shows_the_eta_and_the_ramps_batch(tmp_path):
    run = tmp_path / "run"
    train = [
        sys.executable, "-m", "forgecli.app", "train", "presets/debug.toml", "--run-dir", str(run), *TINY,
        "--model.num_experts=4", "--model.moe_top_k=2", "--train.max_steps=6", "--eval.enabled=false",
        "--train.global_batch_size=8", "--train.batch_ramp_start=4", "--train.batch_ramp_steps=4",
    ]  # fmt: skip
    # tmux starts the command through a shell: COLUMNS from this process would override the pane's width
    command = f"cd {shlex.quote(str(REPO))} && env -u COLUMNS -u LINES -u NO_COLOR {shlex.join(train)}"
    session = f"forge-dashboard-{tmp_path.name}"
    tmux("new-session", "-d", "-s", session, "-x", str(WIDTH), "-y", "50", f"{command}; echo FORGE_EXIT=$?; sleep 600")
    try:
        deadline = time.monotonic() + 240
        screen = ""
        while time.monotonic() < deadline and "FORGE_EXIT=" not in screen:
            time.sleep(1)
            screen = tmux("capture-pane", "-p", "-J", "-S", "-", "-t", session)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    assert "FORGE_EXIT=0" in screen, screen
    lines = screen.splitlines()
    # -J joins the terminal's wraps; a longer line may only be a label and one path, which has no place to break
    too_long = [line for line in lines if len(line) > WIDTH and not line.endswith(str(run))]
    assert not too_long, too_long
    assert "…" not in screen and "Traceback" not in screen, screen
    final = screen[screen.rindex("step 6/6") :]
    for shown in ("loss ", "lr ", "grad norm ", "tokens/s ", "MFU ", "memory ", "batch 8 seqs", "expert imbalance "):
        assert shown in final, (shown, final)
    assert re.search(r"expert imbalance \d+\.\d\d \(layer \d\)", final), final
    assert "the worst MoE layer's max/mean tokens per expert, 1 = balanced" in final
    assert re.search(r"eta \d+:\d\d:\d\d", final), final  # a time, not -:--:--


def test_the_eta_is_a_time_from_the_first_logged_step():
    """rich's own remaining-time column waits for enough samples (it showed -:--:-- for 20 of 30 slow steps): the
    dashboard's ETA is the time per step so far times the steps left, from step 1 on."""
    from forgecli.dashboard import LiveDashboard

    dashboard = LiveDashboard()
    dashboard.max_steps = 30
    dashboard.started -= 12.0  # step 1 took 12 s
    metrics = {"loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 100.0, "mfu": None, "mem_peak_gib": 1.0}
    dashboard.on_log(1, metrics)
    eta = dashboard.progress.tasks[0].fields["eta"]
    hours, minutes, seconds = map(int, eta.split(":"))
    assert abs(3600 * hours + 60 * minutes + seconds - 12 * 29) <= 1, eta
