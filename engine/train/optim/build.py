"""Building the chosen optimizer: its registered builder (`OPTIMIZERS`, named by its config module), given the
optimizer's own config object.

Weight decay applies to matrices only (not norms, biases, embeddings) in all of them. Their state is
tensors and Python numbers, and their param groups may carry extra keys, all of which go through
`torch.distributed.checkpoint.state_dict.get_state_dict` / `set_state_dict` like AdamW's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from engine.config.optimizer import OptimizerConfig
from engine.config.registry import OPTIMIZERS
from engine.train.optim.schedule_free import ScheduleFreeAdamW


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer `cfg.name` registered, built from its own config (the fields its config class declares)."""
    builder = OPTIMIZERS.get(cfg.name).implementation()
    return apply_lr_multipliers(builder(model, OPTIMIZERS.chosen(cfg)))


def apply_lr_multipliers(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Groups that carry μP's `lr_multiplier` (optim/groups.py) train at that multiple of their lr. Done once,
    before the schedule is built, which then scales each group's own lr."""
    for group in optimizer.param_groups:
        if "lr_multiplier" in group:
            group["lr"] = group["lr"] * group["lr_multiplier"]
    return optimizer


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The lr the next step takes (first param group, over its μP multiplier: the base lr), as metrics
    should report it."""
    group = optimizer.param_groups[0]
    lr = ScheduleFreeAdamW.step_lr(group) if isinstance(optimizer, ScheduleFreeAdamW) else group["lr"]
    return float(lr) / group.get("lr_multiplier", 1.0)  # torchao's optimizers keep lr as a tensor


@contextlib.contextmanager
def eval_mode(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside: the parameters hold the weights to evaluate; after: exactly the ones to train again.

    Only schedule-free AdamW tells them apart (it trains at y but its answer is the average x), so use
    this around evaluation; for the other optimizers it does nothing. Switching back by interpolation
    would not return y bit for bit, so y is copied aside and put back: evaluating never changes training.
    """
    if not isinstance(optimizer, ScheduleFreeAdamW):
        yield
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    training_weights = [p.detach().clone() for p in params]
    optimizer.eval()
    try:
        yield
    finally:
        optimizer.train()
        with torch.no_grad():
            for p, y in zip(params, training_weights):
                p.copy_(y)
