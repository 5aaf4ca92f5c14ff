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
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from engine.train.optim.closure import loss_of
from engine.train.optim.groups import hidden_matrices, mup_lr_groups, param_groups
from engine.train.optim.muon_config import MuonConfig
from engine.train.optim.muon_distributed import MeshGroup, orthogonalize_owned

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
        # The process group of each mesh a Muon matrix is sharded on, made here, on every rank at once.
        self.meshes: dict[DeviceMesh, MeshGroup] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if group["use_muon"] and isinstance(p, DTensor) and p.device_mesh not in self.meshes:
                    self.meshes[p.device_mesh] = MeshGroup.of(p.device_mesh)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Momentum for every Muon matrix first, then all of them orthogonalized together (each by one rank,
        engine/train/optim/muon_distributed.py), then the updates; AdamW for the rest."""
        loss = loss_of(closure)
        matrices = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["use_muon"]:
                    matrices.append((p, group, self._nesterov(p, group)))
                else:
                    self._adamw_update(p, group)
        directions = self._orthogonalized(matrices)
        for (p, group, _), direction in zip(matrices, directions):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(direction, alpha=-group["lr"] * update_scale(p.shape))
        return loss

    def _nesterov(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """B ← μ·B + (1 − μ)·g; the Nesterov look-ahead μ·B + (1 − μ)·g that Newton–Schulz orthogonalizes."""
        momentum, state = group["momentum"], self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buffer = state["momentum_buffer"]
        buffer.lerp_(p.grad, 1 - momentum)
        return p.grad.lerp(buffer, momentum)

    def _ns_dtype(self, p: torch.Tensor) -> torch.dtype:
        if self.ns_dtype is not None:
            return self.ns_dtype
        return torch.bfloat16 if p.device.type == "cuda" else torch.promote_types(p.dtype, torch.float32)

    def _orthogonalized(self, matrices: list[tuple[torch.Tensor, dict, torch.Tensor]]) -> list[torch.Tensor]:
        """Each Nesterov matrix orthogonalized: a plain tensor where it is, the DTensors of one mesh (and one
        dtype and iteration count) in one exchange among that mesh's ranks, each by its owner."""
        out: list[torch.Tensor | None] = [None] * len(matrices)
        buckets: dict[tuple, list[int]] = {}
        for j, (p, group, nesterov) in enumerate(matrices):
            if isinstance(nesterov, DTensor):
                key = (nesterov.device_mesh, nesterov.dtype, group["ns_steps"], self._ns_dtype(p))
                buckets.setdefault(key, []).append(j)
            else:
                out[j] = orthogonalize(nesterov, group["ns_steps"], self._ns_dtype(p)).to(nesterov.dtype)
        for (mesh, _, steps, dtype), js in buckets.items():
            updates = [matrices[j][2] for j in js]
            for j, result in zip(js, orthogonalize_owned(updates, self.meshes[mesh], orthogonalize, steps, dtype)):
                out[j] = result
        return out

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
    """Muon on the blocks' matrices at `lr`; AdamW (decay on matrices only) on the rest at `muon_adam_lr`.
    Under μP the matrices' lr takes Muon's multiplier (`ParamScale.muon_lr`), the rest Adam's."""
    matrices = hidden_matrices(model)
    muon_groups = [{"params": matrices, "use_muon": True}]
    if model.cfg.parametrization == "mup":
        muon_groups = mup_lr_groups(model, muon_groups, rule="muon_lr")
    adam_lr = cfg.muon_adam_lr or cfg.lr
    fallback = [
        {**group, "use_muon": False, "lr": adam_lr}
        for group in param_groups(model, cfg.weight_decay, exclude=frozenset(map(id, matrices)))
    ]
    return Muon(
        [*muon_groups, *fallback],
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.muon_momentum,
        ns_steps=cfg.muon_ns_steps,
        betas=cfg.betas,
        eps=cfg.eps,
    )
