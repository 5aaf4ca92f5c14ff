"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from engine.train.optim.closure import loss_of
from engine.train.optim.groups import param_groups
from engine.train.optim.lion_config import LionConfig


class Lion(torch.optim.Optimizer):
    """Per step, with gradient g and momentum m:

        c = β1·m + (1 − β1)·g
        θ ← θ − lr·(sign(c) + λ·θ)          (decoupled weight decay)
        m ← β2·m + (1 − β2)·g

    Only the sign of the interpolated momentum moves the weights, so every coordinate moves by lr: the
    paper uses an lr 3–10× smaller than AdamW's and a λ 3–10× larger (keeping lr·λ), and betas (0.9, 0.99).
    It keeps one state tensor per parameter where AdamW keeps two.
    """

    def __init__(
        self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = loss_of(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update(group, params)
        return loss

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        (beta1, beta2), lr, decay = group["betas"], group["lr"], group["weight_decay"]
        grads = [p.grad for p in params]
        for p in params:
            if "exp_avg" not in self.state[p]:
                self.state[p]["exp_avg"] = torch.zeros_like(p)
        momenta = [self.state[p]["exp_avg"] for p in params]
        direction = torch._foreach_mul(momenta, beta1)
        torch._foreach_add_(direction, grads, alpha=1 - beta1)
        torch._foreach_sign_(direction)
        if decay:
            torch._foreach_mul_(params, 1 - lr * decay)
        torch._foreach_add_(params, direction, alpha=-lr)
        torch._foreach_mul_(momenta, beta2)
        torch._foreach_add_(momenta, grads, alpha=1 - beta2)


def lion(model: nn.Module, cfg: LionConfig) -> torch.optim.Optimizer:
    return Lion(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
