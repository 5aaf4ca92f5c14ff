"""Schedule-Free AdamW (Defazio et al. 2024, "The Road Less Scheduled", Algorithm 1 with Adam's
preconditioner; the facebookresearch/schedule_free `AdamWScheduleFree` form, with its defaults r = 0 and
weight_lr_power = 2).

It keeps three sequences: z (a plain AdamW-preconditioned SGD iterate), x (a running weighted average of
z: the weights to evaluate and save) and y = (1 − β1)·z + β1·x (the point where gradients are taken).
Averaging replaces the LR schedule, so it runs with scheduler `constant` or `none`. The parameters hold y
while training; `eval()` puts x in them (for evaluation and checkpoints) and `train()` puts y back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from engine.train.optim.closure import loss_of
from engine.train.optim.groups import param_groups
from engine.train.optim.schedule_free_config import ScheduleFreeConfig
from engine.train.schedules import schedule_free_warmup


class ScheduleFreeAdamW(torch.optim.Optimizer):
    """Step k (from 0) with gradient g at y, lr_k = lr·warmup(k) and c = lr_max² / Σ lr_max²:

        v ← β2·v + (1 − β2)·g²;   u = g / (sqrt(v / (1 − β2^(k+1))) + ε) + λ·y
        y ← (1 − c)·y + c·z + lr_k·(β1·(1 − c) − 1)·u       (x ← (1 − c)·x + c·z, expressed on y)
        z ← z − lr_k·u

    Per-group bookkeeping (k, the weight sum, the largest lr so far, the mode) lives in the param groups,
    so it is saved and restored with the optimizer's state dict.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.0025,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
    ) -> None:
        if not betas[0] > 0:
            raise ValueError("schedule-free AdamW needs betas[0] > 0: it interpolates its sequences with it")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "warmup_steps": warmup_steps,
            "k": 0,
            "weight_sum": 0.0,
            "lr_max": -1.0,
            "train_mode": True,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def eval(self) -> None:
        """Parameters ← x = (y − (1 − β1)·z) / β1."""
        self._switch(train=False)

    @torch.no_grad()
    def train(self) -> None:
        """Parameters ← y = β1·x + (1 − β1)·z."""
        self._switch(train=True)

    def _switch(self, train: bool) -> None:
        for group in self.param_groups:
            if group["train_mode"] == train:
                continue
            beta1 = group["betas"][0]
            for p in group["params"]:
                if "z" in self.state[p]:
                    p.lerp_(self.state[p]["z"], 1 - beta1 if train else 1 - 1 / beta1)
            group["train_mode"] = train

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        if not all(group["train_mode"] for group in self.param_groups):
            raise RuntimeError("schedule-free AdamW stepped in eval mode: call train() after eval()")
        loss = loss_of(closure)
        for group in self.param_groups:
            self._update(group)
        return loss

    @staticmethod
    def step_lr(group: dict) -> float:
        """The lr the next step of `group` takes: the scheduled lr times the optimizer's own warmup."""
        return group["lr"] * schedule_free_warmup(group["warmup_steps"], group["k"])

    def _update(self, group: dict) -> None:
        (beta1, beta2), k = group["betas"], group["k"]
        lr = self.step_lr(group)
        group["lr_max"] = lr_max = max(lr, group["lr_max"])
        weight = lr_max**2
        group["weight_sum"] += weight
        averaging = weight / group["weight_sum"] if group["weight_sum"] else 0.0
        bias_correction2 = 1 - beta2 ** (k + 1)
        for y in group["params"]:
            if y.grad is None:
                continue
            state = self.state[y]
            if "z" not in state:
                state.update(z=y.clone(), exp_avg_sq=torch.zeros_like(y))
            z, exp_avg_sq = state["z"], state["exp_avg_sq"]
            exp_avg_sq.mul_(beta2).addcmul_(y.grad, y.grad, value=1 - beta2)
            direction = y.grad / exp_avg_sq.div(bias_correction2).sqrt_().add_(group["eps"])
            if group["weight_decay"]:
                direction.add_(y, alpha=group["weight_decay"])
            y.lerp_(z, averaging)
            y.add_(direction, alpha=lr * (beta1 * (1 - averaging) - 1))
            z.sub_(direction, alpha=lr)
        group["k"] = k + 1


def schedule_free_adamw(model: nn.Module, cfg: ScheduleFreeConfig) -> torch.optim.Optimizer:
    return ScheduleFreeAdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        warmup_steps=cfg.schedule_free_warmup_steps,
    )
