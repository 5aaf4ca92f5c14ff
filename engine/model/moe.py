"""The mixture-of-experts feed-forward: a router picks `moe_top_k` of `num_experts` SwiGLU experts per
token, their outputs are mixed by the router's weights, and optional shared experts process every token.

The (token, expert) assignments are sorted by expert, the experts module runs on the sorted rows and the
count of rows per expert (`MoE.routed_experts`), and the outputs are weighted and added back at their
tokens. That module call is the seam of expert parallelism: its input and output hooks
(engine/parallel/expert.py) send the rows to the ranks holding their experts and bring the outputs back, so
the code here stays that of one device. Expert compute has two implementations that compute the same thing:
- `grouped` (default where PyTorch has it): each projection runs as one grouped matrix multiply
  (`F.grouped_mm` / `torch._grouped_mm`) over the jagged per-expert groups — one kernel per projection
  whatever the number of experts.
- `loop`: a plain Python loop over the experts' groups; the fallback where grouped_mm is missing.
`looped_experts`, which gathers each expert's tokens by itself, is the reference both are tested against.

With `moe_capacity_factor`, assignments beyond an expert's capacity (in token order) are dropped: their
weight becomes 0, so the token keeps only its residual (and shared-expert) path for that expert. They
are still computed, which keeps every shape static for torch.compile; the count is reported.

`forward` returns the output and an `MoEStats`: the weighted auxiliary loss (a scalar with gradient, for
the training loss) and detached load statistics (for metrics and the sigmoid router's bias update). The
transformer collects them outside the (compiled, checkpointed) block, so nothing here has side effects;
engine/model/routing_metrics.py turns the last forward's into metrics, each layer reporting its own row
(`MoE.metrics`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.config.model import ModelConfig
from engine.config.registry import ACTIVATIONS
from engine.model.mlp import GatedMLP
from engine.model.routers import (
    Routing,
    balance_loss,
    build_router,
    expert_counts,
    router_z_loss,
    sequence_balance_loss,
    tokens_per_expert,
)

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
        self.act = ACTIVATIONS.get(cfg.activation)
        self.w1 = nn.Parameter(torch.empty(e, d, h))
        self.w3 = nn.Parameter(torch.empty(e, d, h))
        self.w2 = nn.Parameter(torch.empty(e, h, d))

    def forward(
        self,
        xs: torch.Tensor,
        counts: torch.Tensor,
        implementation: str,
        grad_factor: torch.Tensor | None = None,
        weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """See `run_experts`. A module call (not a bare use of the weights) so that FSDP gathers them.
        `weights` (w1, w3, w2), when given, are what runs instead of `stacked()`: a layout that holds only some
        experts on this device passes them as plain tensors (expert parallelism's input hook)."""
        return run_experts(
            self.stacked() if weights is None else weights, self.act, xs, counts, implementation, grad_factor
        )

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
        self.act = ACTIVATIONS.get(cfg.activation)

    def forward(
        self, xs: torch.Tensor, counts: torch.Tensor, implementation: str, grad_factor: torch.Tensor | None = None
    ) -> torch.Tensor:
        """See `run_experts`."""
        return run_experts(self.stacked(), self.act, xs, counts, implementation, grad_factor)

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
        self.capacity_factor = cfg.moe_capacity  # None = dropless
        self.gradient_scale = cfg.moe_gradient_scale
        self.loss_weights = (cfg.moe_aux_loss_weight, cfg.moe_sequence_aux_loss_weight, cfg.moe_router_z_loss_weight)
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
        grad_factor = load.mean() / load.clamp(min=1) if self.gradient_scale else None
        out = self.routed_experts(tokens, routing.experts, weights, grad_factor)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view_as(x), self.stats(routing, x.shape[0], load, dropped)

    def routed_experts(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, grad_factor: torch.Tensor | None
    ) -> torch.Tensor:
        """Σₖ weights[t, k] · expert[experts[t, k]](x[t]) for x [tokens, dim]: sort the assignments by
        expert, run the experts on the sorted rows and the rows per expert, weigh and add the outputs at their
        tokens. Expert parallelism exchanges the rows and outputs in the `self.experts` call's hooks."""
        order, token, counts = sort_by_expert(experts, self.num_experts)
        y = self.experts(x[token].to(matmul_dtype(x)), counts, self.implementation, grad_factor)
        return combine(x, token, y, weights.flatten()[order])

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

    def metrics(self, stats: MoEStats, window: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """This layer's routing metrics for `stats` of one of its forwards, as tensors (the caller syncs once
        for all layers): imbalance = max/mean tokens per expert and load_cv = their coefficient of variation
        (population std / mean; 0 when balanced, sqrt(E/k − 1) when every token goes to the same k experts),
        dropped assignments, the unweighted aux losses, the router's balancing bias (min/max) where it has one,
        and with `window` (tokens per expert summed over several forwards) the experts it never picked."""
        load = stats.load.float()
        mean = load.mean().clamp(min=1e-9)
        row = {
            "imbalance": load.max() / mean,
            "load_cv": load.std(correction=0) / mean,
            "dropped": stats.dropped,
            "balance_loss": stats.balance_loss,
            "sequence_balance_loss": stats.sequence_balance_loss,
            "z_loss": stats.z_loss,
        }
        if window is not None:
            row["dead_experts"] = (window == 0).sum().float()
        bias = getattr(self.router, "bias", None)
        if bias is not None:
            row.update(bias_min=bias.min(), bias_max=bias.max())
        return row

    def input_weights(self) -> list[torch.Tensor]:
        shared = self.shared.input_weights() if self.shared is not None else []
        return [self.router.gate.weight, *self.experts.input_weights(), *shared]

    def output_weights(self) -> list[torch.Tensor]:
        shared = self.shared.output_weights() if self.shared is not None else []
        return [*self.experts.output_weights(), *shared]


def within_capacity(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[tokens, k] bool: whether each assignment is among the first `capacity` of its expert, counting in
    token order (then by rank within a token)."""
    flat = experts.flatten()
    # not F.one_hot, which reads the indices' min and max on the host to check them
    onehot = torch.zeros(flat.shape[0], num_experts, dtype=torch.int64, device=flat.device).scatter_(
        1, flat[:, None], 1
    )
    position = (onehot.cumsum(dim=0) * onehot).sum(dim=-1) - 1  # index of the assignment within its expert
    return (position < capacity).view_as(experts)


def grouped_experts(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    act: Callable,
) -> torch.Tensor:
    """Σₖ weights[t, k] · expert[experts[t, k]](x[t]) for every token t, through grouped matrix multiplies.

    x [tokens, dim]; experts, weights [tokens, k]; w1, w3 [E, dim, hidden]; w2 [E, hidden, dim]."""
    order, token, counts = sort_by_expert(experts, w1.shape[0])
    xs = x[token].to(matmul_dtype(x))
    y = sorted_experts(xs, counts, w1, w3, w2, act, "grouped")
    return combine(x, token, y, weights.flatten()[order])


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts [tokens, k] → (order, token, counts): the flat assignments sorted by expert (stable, so in
    token order within an expert), the token of each sorted assignment, and assignments per expert [E]."""
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    return order, order // experts.shape[1], expert_counts(experts, num_experts)


def run_experts(
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    act: Callable,
    xs: torch.Tensor,
    counts: torch.Tensor,
    implementation: str,
    grad_factor: torch.Tensor | None,
) -> torch.Tensor:
    """`sorted_experts` with the stacked (w1, w3, w2); with grad_factor [E], expert e's weight gradients are
    multiplied by grad_factor[e] (`model.moe_gradient_scale`, or 1/ep under expert parallelism)."""
    if grad_factor is not None:
        weights = tuple(scale_grad(w, grad_factor.to(w.dtype)) for w in weights)
    return sorted_experts(xs, counts, *weights, act, implementation)


def sorted_experts(
    xs: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    act: Callable,
    implementation: str,
) -> torch.Tensor:
    """Unweighted expert outputs for rows already sorted by expert: the first counts[0] rows of xs [n, dim]
    go to expert 0, the next counts[1] to expert 1, … Computed in xs's dtype; `grouped` is one grouped
    matrix multiply per projection, `loop` one expert at a time."""
    dtype = xs.dtype
    w1, w3, w2 = w1.to(dtype), w3.to(dtype), w2.to(dtype)
    if implementation == "grouped":
        offsets = counts.cumsum(0).to(torch.int32)
        hidden = act(grouped_mm(xs, w1, offsets)) * grouped_mm(xs, w3, offsets)
        # Not through `ContiguousGrad`, whose output is a view, which FSDP warns about for a module's output.
        # The callers (`combine`, the expert-parallel exchange) index or multiply it: contiguous gradients.
        return GROUPED_MM(hidden, w2, offs=offsets)
    return torch.cat([(act(rows @ w1[e]) * (rows @ w3[e])) @ w2[e] for e, rows in enumerate(xs.split(counts.tolist()))])


def combine(x: torch.Tensor, token: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ over the sorted assignments of weights · y, added into a zero tensor like x at their tokens."""
    y = y * weights[:, None].to(y.dtype)
    return x.new_zeros(x.shape).index_add(0, token, y.to(x.dtype))


def looped_experts(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    act: Callable,
) -> torch.Tensor:
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
        if grad.numel() == 0:  # an expert-parallel rank that received no token: `contiguous` keeps stride 0
            return torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device)
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
