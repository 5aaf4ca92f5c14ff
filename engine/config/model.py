"""`[model]`: the architecture of the decoder-only transformer."""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from engine.config.base import Section

if TYPE_CHECKING:
    from engine.model.spec import ModelSpec

# Upper bounds of the fields that size the model's tensors: far beyond any model trained so far, and low enough
# that a slip (`max_seq_len = 1e12`) is refused by name rather than passing validation and failing to allocate.
MAX_WIDTH = 2**20  # dim, ffn_hidden_dim, attention_head_dim
MAX_HEADS_OR_LAYERS = 2**14  # n_layers, n_heads, n_kv_heads
MAX_VOCAB = 2**24
MAX_SEQ_LEN = 2**24  # the RoPE table (gpt2: position embeddings) has this many rows
MAX_EXPERTS = 2**16


class ModelConfig(Section):
    dim: int = Field(256, gt=0, le=MAX_WIDTH, description="hidden size")
    n_layers: int = Field(4, gt=0, le=MAX_HEADS_OR_LAYERS, description="number of transformer blocks")
    n_heads: int = Field(4, gt=0, le=MAX_HEADS_OR_LAYERS, description="attention heads")
    n_kv_heads: int | None = Field(
        None, gt=0, le=MAX_HEADS_OR_LAYERS, description="key/value heads for GQA; unset = n_heads"
    )
    vocab_size: int = Field(
        32000, gt=0, le=MAX_VOCAB, description="embedding table size (>= the tokenizer's vocabulary)"
    )
    ffn_dim_multiplier: float = Field(1.0, gt=0, description="scales the Llama-style FFN width")
    ffn_hidden_dim: int | None = Field(
        None, gt=0, le=MAX_WIDTH, description="explicit FFN width; overrides the computed one"
    )
    norm_type: Literal["rmsnorm", "layernorm"] = Field(
        "rmsnorm", description="normalization of every block and the final norm"
    )
    norm_eps: float = Field(1e-5, gt=0, description="epsilon added inside the norms")
    activation: Literal["silu", "gelu", "relu"] = Field(
        "silu", description="gate non-linearity of the gated MLP: silu = SwiGLU, gelu = GeGLU, relu = ReGLU"
    )
    max_seq_len: int = Field(
        2048,
        gt=0,
        le=MAX_SEQ_LEN,
        description="length of the RoPE table (gpt2: of the learned position embeddings); train.seq_len must "
        "not exceed it",
    )
    rope_theta: float = Field(10000.0, gt=0, description="RoPE frequency base")
    tie_embeddings: bool = Field(False, description="share the embedding matrix with the output head")
    qk_norm: bool = Field(False, description="RMSNorm over each head's queries and keys before RoPE")
    init_std: float = Field(
        0.02, gt=0, description="std of the normal weight init; output projections get init_std/sqrt(2*n_layers)"
    )
    model_type: Literal["transformer", "gpt2"] = Field(
        "transformer",
        description="the model family, by its name in the MODELS registry: transformer (Llama-style blocks, "
        "MoE) or gpt2 (LayerNorm, biases, learned positions, GELU MLP; refuses the fields it has no use for)",
    )
    sdpa_backend: Literal["auto", "math", "flash", "efficient", "cudnn"] = Field(
        "auto", description="restrict scaled_dot_product_attention to one kernel; auto lets PyTorch choose"
    )
    parametrization: Literal["sp", "mup"] = Field(
        "sp",
        description="sp = standard; mup = maximal update parametrization (Tensor Programs V, docs/mup.md): "
        "hidden init and lr, output logits and attention scaled with width so tuned hyper-parameters transfer",
    )
    mup_base_dim: int | None = Field(
        None,
        gt=0,
        description="mup only (required there): the dim the hyper-parameters were tuned at; multipliers are "
        "measured against this base model (<= dim; an explicit ffn_hidden_dim must scale to a whole width)",
    )
    attention_head_dim: int | None = Field(
        None,
        gt=0,
        le=MAX_WIDTH,
        description="width of each attention head (even, for RoPE); unset = dim / n_heads. Set, q/k/v are "
        "n_heads × it wide whatever dim is (Hugging Face's head_dim; Qwen3 and Mistral NeMo decouple it)",
    )
    attention_qkv_bias: bool = Field(
        False, description="biases on the query, key and value projections, none on the output one (Qwen2)"
    )
    rope_scaling: Literal["none", "linear", "llama3"] = Field(
        "none",
        description="stretch RoPE to longer contexts: linear divides every frequency by rope_scaling_factor; "
        "llama3 (Llama 3.1) divides the low frequencies only, keeps the high ones and blends between",
    )
    rope_scaling_factor: float = Field(
        1.0, gt=0, description="linear / llama3: how much longer the contexts are than those trained on"
    )
    rope_low_freq_factor: float = Field(
        1.0,
        gt=0,
        description="llama3: wavelengths above rope_original_max_seq_len / this are divided by the factor",
    )
    rope_high_freq_factor: float = Field(
        4.0,
        gt=0,
        description="llama3: wavelengths below rope_original_max_seq_len / this are kept (> rope_low_freq_factor)",
    )
    rope_original_max_seq_len: int | None = Field(
        None, gt=0, description="llama3: the context length the model was first trained at (required by llama3)"
    )
    sliding_window: int | None = Field(
        None,
        gt=0,
        description="each token attends to itself and the sliding_window - 1 tokens before it (Mistral); "
        "unset = the whole causal context",
    )

    # Mixture of experts (engine/model/moe.py). The defaults give a dense model; every other MoE field is
    # read only when num_experts > 0 (config validation rejects them otherwise).
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

    # Multi-token prediction (DeepSeek-V3; engine/model/mtp.py): read only when mtp_depth > 0.
    mtp_depth: int = Field(
        0,
        ge=0,
        description="multi-token prediction modules (DeepSeek-V3): module k predicts the token k + 1 ahead from "
        "module k − 1's states and token k's embedding, through one dense block and the shared head; 0 = off",
    )
    mtp_loss_weight: float = Field(
        0.3,
        ge=0,
        description="weight of the mean multi-token-prediction loss over the modules, added to the main loss "
        "in training (eval loss and generation use the main model only)",
    )

    @model_validator(mode="after")
    def _shapes(self) -> ModelConfig:
        if self.attention_head_dim is None and self.dim % self.n_heads:
            raise ValueError(
                f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}), or attention_head_dim set"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})")
        if self.head_dim % 2 and self.family().rotary:
            what = "attention_head_dim" if self.attention_head_dim else "head_dim = dim / n_heads"
            raise ValueError(f"{what} = {self.head_dim} must be even for RoPE")
        steps = [start for start, _ in self.moe_bias_schedule]
        if not steps or steps[0] != 0 or any(b <= a for a, b in itertools.pairwise(steps)):
            raise ValueError(f"moe_bias_schedule must start at update 0 with strictly increasing updates, got {steps}")
        if any(rate < 0 for _, rate in self.moe_bias_schedule):
            raise ValueError("moe_bias_schedule rates must be >= 0")
        self._mup_fields()
        return self

    def _mup_fields(self) -> None:
        """μP measures its multipliers against a base model: `cfg` at dim = mup_base_dim (engine/model/mup.py),
        no wider than the model, with an FFN width in proportion."""
        base = self.mup_base_dim
        if self.parametrization == "sp":
            if base is not None:
                raise ValueError('mup_base_dim is set, but parametrization = "sp" does not read it: remove it')
            return
        if base is None:
            raise ValueError('parametrization = "mup" needs mup_base_dim, the dim its hyper-parameters were tuned at')
        if base > self.dim:
            raise ValueError(
                f"mup_base_dim ({base}) is larger than dim ({self.dim}): μP transfers from a narrower base "
                "model; set mup_base_dim <= dim"
            )
        if self.ffn_hidden_dim is not None and (self.ffn_hidden_dim * base) % self.dim:
            raise ValueError(
                f"ffn_hidden_dim ({self.ffn_hidden_dim}) · mup_base_dim ({base}) / dim ({self.dim}) is not a whole "
                "number, so the base model has no FFN width in proportion; choose widths that divide"
            )
        if self.is_moe:
            raise ValueError(
                'parametrization = "mup" is not supported for mixtures of experts (num_experts > 0): the router '
                "and the experts' multipliers are not part of the scheme; use a dense model or sp"
            )

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
    def moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    @property
    def expert_ffn_dim(self) -> int:
        """Width of one routed (and one shared) expert."""
        return max(1, round(self.ffn_dim * self.moe_expert_ffn_multiplier))

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head: attention_head_dim, else dim / n_heads."""
        return self.attention_head_dim or self.dim // self.n_heads

    @property
    def attention_dim(self) -> int:
        """Width of the query heads together (wq's output, wo's input): dim unless attention_head_dim is set."""
        return self.n_heads * self.head_dim

    @property
    def ffn_dim(self) -> int:
        """FFN width: explicit, else the family's default (GPT-2: 4 · dim, its MLP not being gated), else the
        gated MLP's 256 * ceil((8/3) * dim * ffn_dim_multiplier / 256)."""
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        default = self.family().default_ffn_dim
        if default is not None:
            return default(self)
        return 256 * math.ceil((8 / 3) * self.dim * self.ffn_dim_multiplier / 256)

    def family(self) -> ModelSpec:
        """The registered spec of `model_type` (engine/model/spec.py, torch-free): what the family says of
        itself, where a field's meaning depends on it."""
        from engine.model.spec import spec_for  # the families import this module: import at use

        return spec_for(self)


MOE_FIELDS = (
    "moe_top_k",
    "moe_frequency",
    "moe_router",
    "moe_shared_experts",
    "moe_aux_loss_weight",
    "moe_capacity_factor",
    "moe_sequence_aux_loss_weight",
    "moe_gradient_scale",
    "moe_bias_schedule",
    "moe_bias_update",
    "moe_n_group",
    "moe_topk_group",
    "moe_packed_experts",
    "moe_expert_ffn_multiplier",
    "moe_router_z_loss_weight",
)
"""The fields only a mixture of experts reads (num_experts > 0): a dense model refuses them
(engine/model/rules.py), and `forge init` drops them when it makes a model dense."""

ROPE_SCALING_FIELDS = {
    "rope_scaling_factor": ("linear", "llama3"),
    "rope_low_freq_factor": ("llama3",),
    "rope_high_freq_factor": ("llama3",),
    "rope_original_max_seq_len": ("llama3",),
}
"""The RoPE scaling fields and the `rope_scaling` types that read them (engine/model/rope.py); the others
refuse them (engine/model/rules.py)."""
