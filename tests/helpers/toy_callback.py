"""A library user's callback, as docs/training.md#callbacks describes: it logs the gradients' root mean
square every `every` steps and counts its logs in the checkpoint. Run as a script it trains
`presets/debug.toml` into RUN_DIR (or resumes the run there) with the plain console and this callback,
registered once: `python -m tests.helpers.toy_callback RUN_DIR [--fail-at STEP] [overrides…]`."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from engine.train.callbacks import Callback


class GradientRms(Callback):
    """Every `every` steps: the RMS of all gradients (as reduced, before clipping), logged as kind
    "grad_rms" with the number of times it has logged, which a resumed run continues."""

    name = "grad_rms"

    def __init__(self, every: int, fail_at: int | None = None) -> None:
        self.every, self.fail_at = every, fail_at
        self.logged = 0
        self.rms: float | None = None

    def before_optimizer_step(self, step, loop) -> None:
        if step % self.every == 0:
            grads = [p.grad.detach().double() for p in loop.job.model.parameters() if p.grad is not None]
            total = sum(g.square().sum() for g in grads)
            self.rms = float((total / sum(g.numel() for g in grads)).sqrt())

    def after_step(self, step, result, loop) -> None:
        if step == self.fail_at:
            raise ValueError("the gradient statistic went wrong")
        if step % self.every == 0:
            self.logged += 1
            loop.log(step, {"grad_rms": self.rms, "grad_rms_logged": self.logged}, "grad_rms")

    def state_dict(self) -> dict:
        return {"logged": self.logged}

    def load_state_dict(self, state: dict) -> None:
        self.logged = state["logged"]


def main(argv: list[str]) -> int:
    from engine.config import load_job_config
    from engine.resilience.signals import Preempted
    from engine.train.callbacks import CallbackFailed
    from engine.train.trainer import train
    from forgecli.dashboard import PlainReporter

    run_dir, rest = Path(argv[0]), argv[1:]
    fail_at = None
    if rest[:1] == ["--fail-at"]:
        fail_at, rest = int(rest[1]), rest[2:]
    cfg = load_job_config(Path(__file__).parents[2] / "presets" / "debug.toml", rest)
    try:
        train(cfg, run_dir, [PlainReporter(), GradientRms(every=3, fail_at=fail_at)])
    except CallbackFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Preempted:
        return 3
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main(sys.argv[1:]))
