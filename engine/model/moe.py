"""The mixture-of-experts feed-forward: a router picks `moe_top_k` of `num_experts` SwiGLU experts per
token, their outputs are mixed by the router's weights, and optional shared experts process every token.

Expert compute has two implementations that compute the same thing:
- `grouped` (default where PyTorch has it): the (token, expert) assignments are sorted by expert and each
  projection runs as one grouped matrix multiply (`F.grouped_mm` / `torch._grouped_mm`) over the jagged
  per-expert groups — one kernel per projection whatever the number of experts.
- `loop`: a plain Python loop over experts; the reference the grouped path is tested against, and the
  fallback where grouped_mm is missing.

With `moe_capacity_factor`, assignments beyond an expert's capacity (in token order) are dropped: their
weight becomes 0, so the token keeps only its residual (and shared-expert) path for that expert. They
are still computed, which keeps every shape static for torch.compile; the count is reported.

`forward` returns the output and an `MoEStats`: the weighted auxiliary loss (a scalar with gradient, for
the training loss) and detached load statistics (for metrics and the sigmoid router's bias update). The
transformer collects them outside the (compiled, checkpointed) block, so nothing here has side effects.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.config.model import ModelConfig
from engine.config.registry import ACTIVATIONS
from engine.model.mlp import GatedMLP
from engine.model.routers import (Routing, balance_loss, build_router, router_z_loss, sequence_balance_loss,
                                  tokens_per_expert)

GROUPED_MM: Callable | None = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class MoEStats(NamedTuple):
    loss: torch.Tensor  # weighted sum of the auxiliary losses (with gradient)
    load: torch.Tensor  # [num_experts] assignments each expert computed for, dropped ones excluded
    dropped: torch.Tensor  # assignments dropped by the capacity limit
    balance_loss: torch.Tensor  # unweighted, detached
    sequence_balance_loss: torch.Tensor
    z_loss: torch.Tensor


class PackedExperts(nn.Module):
    """Each projection of all experts as one tensor: w1, w3 [experts, dim, hidden], w2 [experts, hidden, dim]
    (input-major, so an expert computes x @ w1[e])."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, d, h = cfg.num_experts, cfg.dim, cfg.expert_ffn_dim
        self.w1 = nn.Parameter(torch.empty(e, d, h))
        self.w3 = nn.Parameter(torch.empty(e, d, h))
        self.w2 = nn.Parameter(torch.empty(e, h, d))

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.w1, self.w3, self.w2

    def input_weights(self) -> list[torch.Tensor]:
        return [self.w1, self.w3]

    def output_weights(self) -> list[torch.Tensor]:
        return [self.w2]


class Expert(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, h = cfg.dim, cfg.expert_ffn_dim
        self.w1 = nn.Parameter(torch.empty(d, h))
        self.w3 = nn.Parameter(torch.empty(d, h))
        self.w2 = nn.Parameter(torch.empty(h, d))


class ExpertList(nn.ModuleList):
    """One module per expert (`experts.{e}.w1` …), same layout as `PackedExperts` per expert; the grouped
    path stacks them on every forward."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(Expert(cfg) for _ in range(cfg.num_experts))

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(torch.stack([getattr(e, name) for e in self]) for name in ("w1", "w3", "w2"))  # type: ignore[return-value]

    def input_weights(self) -> list[torch.Tensor]:
        return [w for e in self for w in (e.w1, e.w3)]

    def output_weights(self) -> list[torch.Tensor]:
        return [e.w2 for e in self]


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.moe_top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.gradient_scale = cfg.moe_gradient_scale
        self.loss_weights = (cfg.moe_aux_loss_weight, cfg.moe_sequence_aux_loss_weight, cfg.moe_router_z_loss_weight)
        self.act = ACTIVATIONS.get(cfg.activation)
        self.router = build_router(cfg)
        self.experts = PackedExperts(cfg) if cfg.moe_packed_experts else ExpertList(cfg)
        self.shared = GatedMLP(cfg, cfg.moe_shared_experts * cfg.expert_ffn_dim) if cfg.moe_shared_experts else None
        # Which expert compute runs: a module attribute, not a config field (both compute the same thing).
        self.implementation = "grouped" if GROUPED_MM is not None else "loop"

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEStats]:
        """x [batch, seq, dim] → ([batch, seq, dim], stats)."""
        tokens = x.flatten(0, 1)
        routing = self.router(tokens)
        weights, dropped = routing.weights, torch.zeros((), device=x.device)
        if self.capacity_factor is not None:
            kept = within_capacity(routing.experts, self.num_experts, self.capacity(tokens.shape[0]))
            weights, dropped = weights * kept, (~kept).sum().float()
            load = tokens_per_expert(routing.experts.masked_fill(~kept, self.num_experts), self.num_experts + 1)[:-1]
        else:
            load = tokens_per_expert(routing.experts, self.num_experts)
        w1, w3, w2 = self.experts.stacked()
        if self.gradient_scale:
            factor = (load.mean() / load.clamp(min=1)).to(w1.dtype)
            w1, w3, w2 = (scale_grad(w, factor) for w in (w1, w3, w2))
        compute = grouped_experts if self.implementation == "grouped" else looped_experts
        out = compute(tokens, routing.experts, weights, w1, w3, w2, self.act)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view_as(x), self.stats(routing, x.shape[0], load, dropped)

    def capacity(self, tokens: int) -> int:
        assert self.capacity_factor is not None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def stats(self, routing: Routing, batch: int, load: torch.Tensor, dropped: torch.Tensor) -> MoEStats:
        """The auxiliary losses (each computed only when its weight is non-zero) and the load statistics."""
        zero = torch.zeros((), device=load.device)
        balance_w, sequence_w, z_w = self.loss_weights
        balance = balance_loss(routing.probs, routing.experts) if balance_w else zero
        sequence = sequence_balance_loss(routing.probs, routing.experts, batch) if sequence_w else zero
        z = router_z_loss(routing.logits) if z_w else zero
        loss = balance_w * balance + sequence_w * sequence + z_w * z
        return MoEStats(loss, load, dropped, balance.detach(), sequence.detach(), z.detach())

    def input_weights(self) -> list[torch.Tensor]:
        shared = self.shared.input_weights() if self.shared is not None else []
        return [self.router.gate.weight, *self.experts.input_weights(), *shared]

    def output_weights(self) -> list[torch.Tensor]:
        shared = self.shared.output_weights() if self.shared is not None else []
        return [*self.experts.output_weights(), *shared]


def within_capacity(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[tokens, k] bool: whether each assignment is among the first `capacity` of its expert, counting in
    token order (then by rank within a token)."""
    onehot = F.one_hot(experts.flatten(), num_experts)
    position = (onehot.cumsum(dim=0) * onehot).sum(dim=-1) - 1  # index of the assignment within its expert
    return (position < capacity).view_as(experts)


def grouped_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                    w3: torch.Tensor, w2: torch.Tensor, act: Callable) -> torch.Tensor:
    """Σₖ weights[t, k] · expert[experts[t, k]](x[t]) for every token t, through grouped matrix multiplies.

    x [tokens, dim]; experts, weights [tokens, k]; w1, w3 [E, dim, hidden]; w2 [E, hidden, dim]."""
    assert GROUPED_MM is not None
    k, dtype = experts.shape[1], matmul_dtype(x)
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    token = order // k
    offsets = torch.bincount(flat, minlength=w1.shape[0]).cumsum(0).to(torch.int32)
    xs = x[token].to(dtype)
    hidden = act(grouped_mm(xs, w1.to(dtype), offsets)) * grouped_mm(xs, w3.to(dtype), offsets)
    y = grouped_mm(hidden, w2.to(dtype), offsets) * weights.flatten()[order, None].to(dtype)
    return x.new_zeros(x.shape).index_add(0, token, y.to(x.dtype))


def looped_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                   w3: torch.Tensor, w2: torch.Tensor, act: Callable) -> torch.Tensor:
    """The same as `grouped_experts`, one expert at a time (experts with no tokens are skipped)."""
    k, dtype = experts.shape[1], matmul_dtype(x)
    flat, flat_weights = experts.flatten(), weights.flatten()
    out = x.new_zeros(x.shape)
    for e in range(w1.shape[0]):
        assignment = (flat == e).nonzero().squeeze(1)
        if assignment.numel() == 0:
            continue
        token = assignment // k
        xs = x[token].to(dtype)
        hidden = act(xs @ w1[e].to(dtype)) * (xs @ w3[e].to(dtype))
        y = (hidden @ w2[e].to(dtype)) * flat_weights[assignment, None].to(dtype)
        out = out.index_add(0, token, y.to(x.dtype))
    return out


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of x would run in: the autocast dtype when autocast is on (grouped_mm has no
    autocast rule, so the casts are explicit), else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    assert GROUPED_MM is not None
    return ContiguousGrad.apply(GROUPED_MM(a, b, offs=offsets))


class ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's backward rejects
    stride-0 gradients (e.g. the expanded gradient of a `.sum()`)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def scale_grad(weight: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Identity on `weight` [E, …] whose gradient is multiplied by factor[e] for expert e."""
    return ScaleGrad.apply(weight, factor)


class ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(factor)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (factor,) = ctx.saved_tensors
        return grad * factor.view(-1, *([1] * (grad.dim() - 1))), None
