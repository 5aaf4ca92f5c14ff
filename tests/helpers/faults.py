"""Injected faults for the resilience tests."""

from __future__ import annotations

import torch

from engine.train.callbacks import Callback


class Faults(Callback):
    """NaN gradients at `nan_grad_steps`, logits × `spike_scale` at `spike_steps`, NaN weights at `nan_weight_steps`."""

    def __init__(self, nan_grad_steps=(), spike_steps=(), nan_weight_steps=(), spike_scale=30.0) -> None:
        self.nan_grad_steps, self.spike_steps, self.nan_weight_steps = (
            set(nan_grad_steps),
            set(spike_steps),
            set(nan_weight_steps),
        )
        self.spike_scale, self.handle = spike_scale, None

    def before_step(self, step, loop) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        if step in self.spike_steps:
            self.handle = loop.job.model.output.register_forward_hook(lambda m, i, out: out * self.spike_scale)

    def before_optimizer_step(self, step, loop) -> None:
        if step in self.nan_grad_steps:
            next(loop.job.model.parameters()).grad.fill_(float("nan"))
        if step in self.nan_weight_steps:
            with torch.no_grad():
                loop.job.model.norm.weight.fill_(float("nan"))
