"""Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks",
kellerjordan.github.io/posts/muon) for the hidden matrices, AdamW for everything else.

Muon replaces the momentum of a weight matrix by its nearest semi-orthogonal matrix, computed with a few
Newton–Schulz iterations, so that every direction of the update moves by the same amount. It is defined
for 2-D weights inside the network; embeddings, the output head, norms and biases keep AdamW.

The update is scaled by 0.2·sqrt(max(rows, cols)) (Liu et al. 2025, "Muon is Scalable for LLM
Training"), which gives it the RMS of a typical AdamW update: Muon then takes AdamW's lr and weight
decay, and switching `optimizer.name` between the two is a fair comparison.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from engine.train.optim.closure import loss_of
from engine.train.optim.groups import hidden_matrices, param_groups
from engine.train.optim.muon_config import MuonConfig

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic of Jordan et al.: steepest slope at 0 that still converges
NS_EPS = 1e-7


def orthogonalize(matrix: torch.Tensor, steps: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """≈ U·Vᵀ for matrix = U·S·Vᵀ, by `steps` Newton–Schulz iterations X ← aX + (bA + cA²)X, A = XXᵀ.

    The matrix is first divided by its Frobenius norm so its singular values are ≤ 1; the quintic moves
    each of them towards 1 but not onto it (to about 0.7–1.2, all but the tiniest), which Jordan et al.
    found does not hurt training and buys the fewest iterations. Computed on the wide orientation
    (rows ≤ cols) so that A is the smaller Gram matrix.
    """
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def orthogonalize_full(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Orthogonalize the whole matrix even when `update` is a shard of it (an FSDP2 DTensor): every rank
    gathers the full matrix, orthogonalizes it, and keeps its own shard of the result. Orthogonalizing
    shards separately would give a different (and wrong) update."""
    if not isinstance(update, DTensor):
        return orthogonalize(update, steps, dtype).to(update.dtype)
    full = orthogonalize(update.full_tensor(), steps, dtype).to(update.dtype)
    return distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)


def update_scale(shape: torch.Size) -> float:
    """0.2·sqrt(max(rows, cols)): an orthogonal update's RMS is 1/sqrt(max(rows, cols)); this makes it 0.2,
    AdamW's typical update RMS (Liu et al. 2025)."""
    return 0.2 * math.sqrt(max(shape[0], shape[1]))


class Muon(torch.optim.Optimizer):
    """Muon on param groups with `use_muon=True` (2-D only), AdamW on the others.

    Muon step for a matrix θ with gradient g and momentum buffer B (Nesterov, as Jordan et al.):

        B ← μ·B + (1 − μ)·g
        O = NewtonSchulz(μ·B + (1 − μ)·g)
        θ ← θ·(1 − lr·λ) − lr·0.2·sqrt(max(rows, cols))·O

    `ns_dtype` is the precision of the Newton–Schulz matmuls: unset = bfloat16 on CUDA (as the
    reference implementation, for speed) and float32 elsewhere (float64 for float64 parameters).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        ns_steps: int = 5,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        ns_dtype: torch.dtype | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "use_muon": True,
            "momentum": momentum,
            "ns_steps": ns_steps,
            "betas": betas,
            "eps": eps,
        }
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            if group["use_muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError(
                    "Muon orthogonalizes 2-D matrices only; put other parameters in a group with use_muon=False"
                )

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = loss_of(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    (self._muon_update if group["use_muon"] else self._adamw_update)(p, group)
        return loss

    def _muon_update(self, p: torch.Tensor, group: dict) -> None:
        momentum, lr = group["momentum"], group["lr"]
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buffer = state["momentum_buffer"]
        buffer.lerp_(p.grad, 1 - momentum)
        nesterov = p.grad.lerp(buffer, momentum)
        dtype = self.ns_dtype or (
            torch.bfloat16 if p.device.type == "cuda" else torch.promote_types(p.dtype, torch.float32)
        )
        direction = orthogonalize_full(nesterov, group["ns_steps"], dtype)
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(direction, alpha=-lr * update_scale(p.shape))

    def _adamw_update(self, p: torch.Tensor, group: dict) -> None:
        """AdamW with decoupled weight decay, operation for operation as torch.optim.AdamW (single tensor)."""
        (beta1, beta2), lr = group["betas"], group["lr"]
        state = self.state[p]
        if "step" not in state:
            state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        state["step"] += 1
        exp_avg, exp_avg_sq, step = state["exp_avg"], state["exp_avg_sq"], state["step"]
        p.mul_(1 - lr * group["weight_decay"])
        exp_avg.lerp_(p.grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
        p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))


def muon(model: nn.Module, cfg: MuonConfig) -> torch.optim.Optimizer:
    """Muon on the blocks' matrices at `lr`; AdamW (decay on matrices only) on the rest at `muon_adam_lr`."""
    matrices = hidden_matrices(model)
    adam_lr = cfg.muon_adam_lr or cfg.lr
    fallback = [
        {**group, "use_muon": False, "lr": adam_lr}
        for group in param_groups(model, cfg.weight_decay, exclude=frozenset(map(id, matrices)))
    ]
    return Muon(
        [{"params": matrices, "use_muon": True}, *fallback],
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.muon_momentum,
        ns_steps=cfg.muon_ns_steps,
        betas=cfg.betas,
        eps=cfg.eps,
    )
