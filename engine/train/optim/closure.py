"""The `step(closure)` contract of `torch.optim.Optimizer`, shared by our optimizers."""

from __future__ import annotations

from collections.abc import Callable

import torch


def loss_of(closure: Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
    """Run the closure (which recomputes the loss and gradients) with autograd on, inside a no-grad step."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
