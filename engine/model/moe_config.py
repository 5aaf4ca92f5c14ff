"""The mixture of experts' config (torch-free, beside engine/model/moe.py): its `[model]` fields, for the families
whose config class derives from `ExpertFields` (a family that does not has no experts, and its config refuses
the fields), and the sizes they set.

The defaults give a dense model; every other MoE field is read only when num_experts > 0 (config validation
rejects them otherwise: engine/model/rules.py)."""

from __future__ import annotations

import itertools
from typing import Literal

from pydantic import Field

from engine.config.model import MAX_EXPERTS, ModelFields


class ExpertFields(ModelFields):
    """The fields of a mixture of experts (engine/model/moe.py)."""

    num_experts: int = Field(0, ge=0, le=MAX_EXPERTS, description="routed experts per MoE block; 0 = dense model")
    moe_top_k: int = Field(2, gt=0, description="experts each token is routed to (<= num_experts)")
    moe_frequency: int = Field(
        1,
        gt=0,
        description="MoE in every N-th block: block i (from 0) is MoE when (i + 1) % N == 0; 1 = all, 2 = "
        "blocks 1, 3, … (<= n_layers)",
    )
    moe_router: Literal["softmax_topk", "softmax_topk_renorm", "sigmoid_topk"] = Field(
        "softmax_topk",
        description="softmax_topk: top-k of softmax probabilities; softmax_topk_renorm: the same top-k, "
        "weights renormalised to sum to 1 (Mixtral); sigmoid_topk: DeepSeek-V3 sigmoid scores, top-k of "
        "score + balancing bias (within the best moe_topk_group groups), weights = selected scores renormalised",
    )
    moe_shared_experts: int = Field(
        0, ge=0, description="experts (of the routed experts' width) that process every token"
    )
    moe_aux_loss_weight: float = Field(
        0.01, ge=0, description="Switch-style load-balance loss weight (over the micro-batch)"
    )
    moe_capacity_factor: float | None = Field(
        None,
        ge=0,
        description="expert capacity = ceil(factor · tokens · top_k / num_experts); assignments beyond "
        "it are dropped (counted); unset or 0 = no capacity limit (dropless, the seed schema's 0)",
    )
    moe_sequence_aux_loss_weight: float = Field(
        0.0, ge=0, description="sequence-level balance loss weight (DeepSeek-V3); 0 = off"
    )
    moe_gradient_scale: bool = Field(
        False,
        description="divide each expert's weight gradient by its token count relative to the mean load, so "
        "rarely chosen experts get updates of the same size as popular ones",
    )
    moe_bias_schedule: list[tuple[int, float]] = Field(
        default_factory=lambda: [(0, 1e-3)],
        description="sigmoid_topk only: balancing-bias update rate as [[from_update, rate], …]; after each "
        "training forward, bias += rate · step (model.moe_bias_update); updates are counted per "
        "forward (micro-batch)",
    )
    moe_bias_update: Literal["sign", "proportional"] = Field(
        "sign",
        description="sigmoid_topk only: how the balancing bias moves: sign = rate · sign(mean − load) "
        "(DeepSeek-V3), proportional = rate · (mean − load) / mean (large steps for an expert far above the "
        "mean, small ones near balance)",
    )
    moe_n_group: int = Field(
        1,
        gt=0,
        description="sigmoid_topk only: group-limited routing (DeepSeek-V3): the experts form this many equal "
        "groups (num_experts / moe_n_group each, at least 2); 1 = no groups",
    )
    moe_topk_group: int = Field(
        1,
        gt=0,
        description="sigmoid_topk only: groups each token keeps (<= moe_n_group), ranked by the sum of their two "
        "best biased scores; its top-k experts are chosen inside them",
    )
    moe_packed_experts: bool = Field(
        True, description="store each projection of all experts as one [experts, …] tensor (else one module per expert)"
    )
    moe_expert_ffn_multiplier: float = Field(
        1.0, gt=0, description="expert width = round(ffn_dim · multiplier); < 1 gives fine-grained experts"
    )
    moe_router_z_loss_weight: float = Field(
        0.0, ge=0, description="router z-loss weight: mean logsumexp(router logits)²"
    )

    def check_experts(self) -> None:
        """The balancing-bias schedule is one that can be followed."""
        steps = [start for start, _ in self.moe_bias_schedule]
        if not steps or steps[0] != 0 or any(b <= a for a, b in itertools.pairwise(steps)):
            raise ValueError(f"moe_bias_schedule must start at update 0 with strictly increasing updates, got {steps}")
        if any(rate < 0 for _, rate in self.moe_bias_schedule):
            raise ValueError("moe_bias_schedule rates must be >= 0")

    def check(self) -> None:
        super().check()
        self.check_experts()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_capacity(self) -> float | None:
        """The capacity factor that limits routing, or None for dropless (unset, or 0 as in the seed schema)."""
        return self.moe_capacity_factor or None

    def is_moe_layer(self, layer: int) -> bool:
        """Block `layer` (0-based) has an MoE feed-forward: with moe_frequency = N, blocks N-1, 2N-1, …"""
        return self.is_moe and (layer + 1) % self.moe_frequency == 0

    @property
    def expert_ffn_dim(self) -> int:
        """Width of one routed (and one shared) expert."""
        return max(1, round(self.ffn_dim * self.moe_expert_ffn_multiplier))


MOE_FIELDS = tuple(name for name in ExpertFields.model_fields if name not in (*ModelFields.model_fields, "num_experts"))
"""The fields only a mixture of experts reads (num_experts > 0), after num_experts itself: a dense model refuses
them (engine/model/rules.py), and `forge init` drops them when it makes a model dense."""
