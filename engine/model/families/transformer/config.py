"""The transformer family's config (torch-free): the `[model]` fields only it reads — grouped-query heads, the
gated MLP's width and activation, the choice of norm, RoPE and its scaling, QK-norm, q/k/v biases, a decoupled
head width, a sliding window, a gated attention output, attention sinks, μP, the mixture of experts (`ExpertFields`) and multi-token prediction — and the
sizes they change. Registered with the family's spec in `__init__.py`."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from engine.config.model import MAX_HEADS_OR_LAYERS, MAX_WIDTH, NormChoice
from engine.model.moe_config import ExpertFields


class TransformerFields(NormChoice):
    """The transformer's attention, MLP and position fields (declared before the experts' fields, the order the
    resolved config lists them in)."""

    n_kv_heads: int | None = Field(
        None, gt=0, le=MAX_HEADS_OR_LAYERS, description="key/value heads for GQA; unset = n_heads"
    )
    ffn_dim_multiplier: float = Field(1.0, gt=0, description="scales the Llama-style FFN width")
    activation: Literal["silu", "gelu", "relu"] = Field(
        "silu", description="gate non-linearity of the gated MLP: silu = SwiGLU, gelu = GeGLU, relu = ReGLU"
    )
    rope_theta: float = Field(10000.0, gt=0, description="RoPE frequency base")
    qk_norm: bool = Field(False, description="RMSNorm over each head's queries and keys before RoPE")
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
    attention_output_gate: bool = Field(
        False,
        description="multiply each head's attention output by a sigmoid gate of the block's input before wo "
        "(Qwen3-Next's gated attention): wq is twice as wide, each head's query followed by its gate",
    )
    attention_sinks: bool = Field(
        False,
        description="a learned logit per head that joins every softmax's denominator and attends to nothing "
        "(GPT-OSS's sinks): a query may give part of its attention to no key; runs on an eager kernel "
        "(FlexAttention for packed windows on CUDA), not SDPA: sdpa_backend stays auto",
    )


class TransformerConfig(ExpertFields, TransformerFields):
    """The transformer's fields: its own, the experts' and multi-token prediction's."""

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

    def check(self) -> None:
        if self.attention_head_dim is None and self.dim % self.n_heads:
            raise ValueError(
                f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}), or attention_head_dim set"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            what = "attention_head_dim" if self.attention_head_dim else "head_dim = dim / n_heads"
            raise ValueError(f"{what} = {self.head_dim} must be even for RoPE")
        self.check_experts()
        self._mup_fields()

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
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head: attention_head_dim, else dim / n_heads."""
        return self.attention_head_dim or self.dim // self.n_heads

    def default_ffn_dim(self) -> int:
        """The gated MLP's 256 * ceil((8/3) * dim * ffn_dim_multiplier / 256)."""
        return 256 * math.ceil((8 / 3) * self.dim * self.ffn_dim_multiplier / 256)


ROPE_SCALING_FIELDS = {
    "rope_scaling_factor": ("linear", "llama3"),
    "rope_low_freq_factor": ("llama3",),
    "rope_high_freq_factor": ("llama3",),
    "rope_original_max_seq_len": ("llama3",),
}
"""The RoPE scaling fields and the `rope_scaling` types that read them (engine/model/rope.py); the others
refuse them (engine/model/rules.py)."""
