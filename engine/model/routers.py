"""MoE routers, chosen by `model.moe_router`, and the balance losses computed from their outputs.

A router maps token states [tokens, dim] to a `Routing`: the top-k experts of each token, the weights that
mix their outputs, and the per-expert probabilities the balance losses use. Router logits are computed in
fp32 whatever the compute dtype, because top-k selection is sensitive to rounding.

- `softmax_topk` (Switch / GShard / Mixtral family): probabilities = softmax(logits); each token goes to
  its k most probable experts with their probabilities as weights (not renormalised, so top-1 routing
  still passes a gradient to the router).
- `softmax_topk_renorm` (Mixtral): the same choice, with the k weights divided by their sum, so they sum
  to 1 (with top-1 routing the weight is then always 1 and only the balance losses train the router).
- `sigmoid_topk` (DeepSeek-V3): scores = sigmoid(logits); the k experts are chosen by score + bias, where
  the per-expert bias is not learned by gradient but nudged after each training forward toward balance
  (auxiliary-loss-free balancing, `model.moe_bias_schedule`); weights are the chosen scores (without
  the bias) renormalised to sum to 1. With group-limited routing (`model.moe_n_group` groups of
  consecutive experts, `model.moe_topk_group` kept) a token first keeps the groups whose two best biased
  scores sum highest and picks its k experts inside them only (`group_limited`), which bounds how many
  devices (or nodes) one token's experts span when the groups are laid out along them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.config.model import ModelConfig
from engine.config.registry import ROUTERS


class Routing(NamedTuple):
    experts: torch.Tensor  # [tokens, k] int64: the chosen experts of each token
    weights: torch.Tensor  # [tokens, k] fp32: how much each chosen expert's output counts
    probs: torch.Tensor  # [tokens, experts] fp32: the distribution the balance losses see (sums to 1 per token)
    logits: torch.Tensor  # [tokens, experts] fp32: raw router logits (z-loss)


@ROUTERS.register("softmax_topk")
class SoftmaxTopK(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.moe_top_k
        self.gate = nn.Linear(cfg.dim, cfg.num_experts, bias=False)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> Routing:
        """`weight`, when given, runs instead of `gate.weight`: a layout that holds the gate as a DTensor
        passes its local tensor (tensor parallelism's input hook, engine/parallel/tp.py)."""
        logits = F.linear(x.float(), (self.gate.weight if weight is None else weight).float())
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        return Routing(experts, weights, probs, logits)


@ROUTERS.register("softmax_topk_renorm")
class SoftmaxTopKRenorm(SoftmaxTopK):
    """Mixtral's router: `SoftmaxTopK`'s experts, their weights renormalised to sum to 1."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> Routing:
        """`weight`: as in `SoftmaxTopK.forward`."""
        experts, weights, probs, logits = super().forward(x, weight)
        return Routing(experts, weights / weights.sum(dim=-1, keepdim=True), probs, logits)


def group_limited(biased: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """`biased` [tokens, experts] with every expert outside a token's best `topk_group` of `n_group` groups
    (consecutive, equal) set to -inf, so a top-k over it picks inside those groups only. A group's score is
    the sum of its two best biased scores (DeepSeek-V3's rule; its best one when a group has one expert).
    With one group nothing is masked and the result equals `biased` bitwise."""
    grouped = biased.unflatten(-1, (n_group, -1))
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    kept = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, kept, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)


@ROUTERS.register("sigmoid_topk")
class SigmoidTopK(nn.Module):
    """The balancing state lives in persistent buffers, so checkpoints hold it and a resumed run routes
    exactly as the uninterrupted one: `bias` (added to scores for selection only), `pending_load` (tokens
    per expert of the last training forward, not yet applied) and `updates` (bias updates so far, which
    picks the rate from `moe_bias_schedule`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.moe_top_k
        self.n_group, self.topk_group = cfg.moe_n_group, cfg.moe_topk_group
        self.schedule = cfg.moe_bias_schedule
        self.step_of = BIAS_UPDATES[cfg.moe_bias_update]
        self.gate = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.register_buffer("bias", torch.zeros(cfg.num_experts))
        self.register_buffer("pending_load", torch.zeros(cfg.num_experts))
        self.register_buffer("updates", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> Routing:
        """`weight`: as in `SoftmaxTopK.forward`."""
        logits = F.linear(x.float(), (self.gate.weight if weight is None else weight).float())
        scores = logits.sigmoid()
        # Only the indices of the choice are used: no gradient flows through it, so autograd keeps nothing of it.
        biased = group_limited(scores.detach() + self.bias, self.n_group, self.topk_group)
        experts = biased.topk(self.top_k, dim=-1).indices
        chosen = scores.gather(-1, experts)
        weights = chosen / chosen.sum(dim=-1, keepdim=True)
        return Routing(experts, weights, scores / scores.sum(dim=-1, keepdim=True), logits)

    def rate(self, update: torch.Tensor) -> torch.Tensor:
        """The schedule's rate at `update` (a count held as a tensor), computed on its device: the first rate
        plus each later change of the schedule from its start on. Reading the count on the host would wait
        for the device."""
        (_, first), *later = self.schedule
        rate = torch.full((), first, dtype=torch.float32, device=update.device)
        for (_, before), (start, after) in zip(self.schedule, later):
            rate = rate + (after - before) * (update >= start)
        return rate

    @torch.no_grad()
    def record_load(self, load: torch.Tensor) -> None:
        """Remember a training forward's tokens per expert; `apply_bias_update` uses it before the next one.

        Applying it only then (not right away) keeps routing identical between a forward and the
        recomputation of that forward in backward under activation checkpointing."""
        self.pending_load.copy_(load)

    @torch.no_grad()
    def apply_bias_update(self) -> None:
        """bias += rate · step(load) (`model.moe_bias_update`, `BIAS_UPDATES`): underloaded experts become
        likelier picks, overloaded ones less likely. Changes nothing when no load is pending (the first
        forward, or after evaluation-only use: the step of an all-zero load is 0 and the update count stays).
        All on the device, with no host synchronisation, so that it does not stall the forward it precedes."""
        load = self.pending_load
        self.bias.add_(self.rate(self.updates) * self.step_of(load))
        self.updates.add_(load.any().long())
        self.pending_load.zero_()


def sign_step(load: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's update: sign(mean − load), ±1 whatever the size of the imbalance."""
    return torch.sign(load.mean() - load)


def proportional_step(load: torch.Tensor) -> torch.Tensor:
    """(mean − load) / mean: an expert at k times the mean load moves by k − 1 times the rate, one near the
    mean barely moves; an underloaded expert moves by at most the rate."""
    mean = load.mean()
    return (mean - load) / mean.clamp(min=1e-9)


BIAS_UPDATES = {"sign": sign_step, "proportional": proportional_step}  # model.moe_bias_update


def build_router(cfg: ModelConfig) -> nn.Module:
    return ROUTERS.get(cfg.moe_router)(cfg)


def tokens_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[num_experts] fp32 count of (token, expert) assignments in `experts` [..., k]."""
    return expert_counts(experts, num_experts).float()


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[num_experts] int64 count of the assignments in `experts` [..., k], by a scatter-add of ones into a
    fixed-size tensor: exact (integers), and unlike `torch.bincount`, whose output size depends on the data,
    it never waits for the device to learn the largest index."""
    flat = experts.flatten()
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def balance_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch Transformer load-balance loss, E · Σₑ fₑ · Pₑ, with fₑ the fraction of the k·tokens
    assignments that went to expert e (no gradient) and Pₑ the mean probability of e. 1 when balanced.

    probs [tokens, E], experts [tokens, k]."""
    num_experts = probs.shape[-1]
    fraction = tokens_per_expert(experts, num_experts) / experts.numel()
    return num_experts * (fraction * probs.mean(dim=0)).sum()


def sequence_balance_loss(probs: torch.Tensor, experts: torch.Tensor, batch: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss: `balance_loss` within each of the `batch` sequences (the
    tokens are [batch · seq] in order), averaged over sequences. Keeps any one sequence from piling onto
    a few experts even when the micro-batch as a whole is balanced."""
    num_experts, k = probs.shape[-1], experts.shape[-1]
    probs, experts = probs.view(batch, -1, num_experts), experts.view(batch, -1, k)
    counts = torch.zeros(batch, num_experts, device=probs.device).scatter_add_(
        1, experts.flatten(1), torch.ones(experts.flatten(1).shape, device=probs.device)
    )
    fraction = counts / experts[0].numel()
    return num_experts * (fraction * probs.mean(dim=1)).sum(dim=1).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)², which keeps router logits small."""
    return torch.logsumexp(logits, dim=-1).square().mean()
