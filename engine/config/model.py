"""`[model]`: the architecture, chosen by `model_type` (a model family) and sized by the fields every family reads.

`model_type`, the widths, the depth, the vocabulary, the position table, the init and the attention kernel are every
family's (`ModelFields`); each family's own fields are declared by its config class in its folder
(engine/model/families/NAME/config.py, registered in `MODELS` with its `ModelSpec`), and `ModelConfig`, the
`[model]` table, is composed of them all (engine/config/registry.py: `ComponentRegistry`). A field set away from its
default while a family that does not declare it is chosen is a config error naming the field and the family
(engine/model/rules.py: family_issues), so no field is silently ignored; left at its default, as every saved run
config has it, it loads.

What a field's meaning depends on the family for (the head width, the FFN width, whether a block has experts) is
asked of the chosen family's config object (`ModelConfig.family_config()`), which the section's properties return.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.config.base import Section
from engine.config.registry import MODELS

# Upper bounds of the fields that size the model's tensors: far beyond any model trained so far, and low enough
# that a slip (`max_seq_len = 1e12`) is refused by name rather than passing validation and failing to allocate.
MAX_WIDTH = 2**20  # dim, ffn_hidden_dim, attention_head_dim
MAX_HEADS_OR_LAYERS = 2**14  # n_layers, n_heads, n_kv_heads
MAX_VOCAB = 2**24
MAX_SEQ_LEN = 2**24  # the RoPE table (gpt2: position embeddings) has this many rows
MAX_EXPERTS = 2**16


class ModelFields(Section):
    """The fields every model family reads; a family's config class derives from it (or from a mixin that does)
    and overrides the derived sizes below where its own fields change them."""

    dim: int = Field(256, gt=0, le=MAX_WIDTH, description="hidden size")
    n_layers: int = Field(4, gt=0, le=MAX_HEADS_OR_LAYERS, description="number of transformer blocks")
    n_heads: int = Field(4, gt=0, le=MAX_HEADS_OR_LAYERS, description="attention heads")
    vocab_size: int = Field(
        32000, gt=0, le=MAX_VOCAB, description="embedding table size (>= the tokenizer's vocabulary)"
    )
    ffn_hidden_dim: int | None = Field(
        None, gt=0, le=MAX_WIDTH, description="explicit FFN width; overrides the computed one"
    )
    norm_eps: float = Field(1e-5, gt=0, description="epsilon added inside the norms")
    max_seq_len: int = Field(
        2048,
        gt=0,
        le=MAX_SEQ_LEN,
        description="length of the RoPE table (gpt2: of the learned position embeddings); train.seq_len must "
        "not exceed it",
    )
    tie_embeddings: bool = Field(False, description="share the embedding matrix with the output head")
    init_std: float = Field(
        0.02, gt=0, description="std of the normal weight init; output projections get init_std/sqrt(2*n_layers)"
    )
    model_type: str = Field(
        "transformer",
        description="the model family, by its name in the MODELS registry: transformer (Llama-style blocks, "
        "MoE) or gpt2 (LayerNorm, biases, learned positions, GELU MLP; refuses the fields it has no use for)",
    )
    sdpa_backend: Literal["auto", "math", "flash", "efficient", "cudnn"] = Field(
        "auto", description="restrict scaled_dot_product_attention to one kernel; auto lets PyTorch choose"
    )

    def check(self) -> None:
        """The family's checks of the values it is given (raise ValueError): here, heads that split dim."""
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")

    @property
    def kv_heads(self) -> int:
        """Key/value heads (every query head has its own unless the family groups them)."""
        return self.n_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def attention_dim(self) -> int:
        """Width of the query heads together (wq's output, wo's input)."""
        return self.n_heads * self.head_dim

    @property
    def ffn_dim(self) -> int:
        """FFN width: ffn_hidden_dim, else the family's default (`default_ffn_dim`)."""
        return self.ffn_hidden_dim if self.ffn_hidden_dim is not None else self.default_ffn_dim()

    def default_ffn_dim(self) -> int:
        """The MLP width when ffn_hidden_dim is unset: 4 · dim, a non-gated MLP's."""
        return 4 * self.dim

    @property
    def is_moe(self) -> bool:
        """Whether any block has a mixture of experts (engine/model/moe_config.py: `ExpertFields`)."""
        return False

    def is_moe_layer(self, layer: int) -> bool:
        """Block `layer` (0-based) has an MoE feed-forward."""
        return False

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))


class NormChoice(ModelFields):
    """The choice of norm, for the families whose norm is not fixed."""

    norm_type: Literal["rmsnorm", "layernorm"] = Field(
        "rmsnorm", description="normalization of every block and the final norm"
    )


class ModelConfig(ModelFields):
    """The `[model]` table: the shared fields and every registered family's own ones (composed by `MODELS.bind`
    below). Its derived sizes are the chosen family's (`family_config()`)."""

    @model_validator(mode="after")
    def _chosen_family_checks(self) -> ModelConfig:
        if self.model_type in MODELS.names():
            self.family_config().check()
        return self

    def family_config(self) -> ModelFields:
        """The chosen family's own config object: the values of the fields its class declares."""
        return MODELS.chosen(self)

    @property
    def kv_heads(self) -> int:
        return self.family_config().kv_heads

    @property
    def head_dim(self) -> int:
        return self.family_config().head_dim

    @property
    def attention_dim(self) -> int:
        return self.family_config().attention_dim

    @property
    def ffn_dim(self) -> int:
        return self.family_config().ffn_dim

    @property
    def is_moe(self) -> bool:
        return self.family_config().is_moe

    def is_moe_layer(self, layer: int) -> bool:
        return self.family_config().is_moe_layer(layer)

    @property
    def expert_ffn_dim(self) -> int:
        """Width of one routed (and one shared) expert, for a family with experts."""
        return self.family_config().expert_ffn_dim

    @property
    def moe_capacity(self) -> float | None:
        """The capacity factor that limits routing, or None for dropless, for a family with experts."""
        return self.family_config().moe_capacity


SAVED_ORDER = (
    *("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim_multiplier", "ffn_hidden_dim", "norm_type"),
    *("norm_eps", "activation", "max_seq_len", "rope_theta", "tie_embeddings", "qk_norm", "init_std", "model_type"),
    "sdpa_backend",
)
"""The keys of `[model]` that the resolved config (a run directory's config.toml, validate-config's output) has
always listed in this order, shared and the transformer's interleaved; every other field follows, in the order its
family declares it."""

import engine.model.families  # noqa: E402, F401  (registers every family's config and spec: torch-free)

MODELS.bind(ModelConfig, ModelFields, order=SAVED_ORDER)
