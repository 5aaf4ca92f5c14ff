"""`[model]`: the architecture of the decoder-only transformer."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from engine.config.base import Section


class ModelConfig(Section):
    dim: int = Field(256, gt=0, description="hidden size")
    n_layers: int = Field(4, gt=0, description="number of transformer blocks")
    n_heads: int = Field(4, gt=0, description="attention heads")
    n_kv_heads: int | None = Field(None, gt=0, description="key/value heads for GQA; None = n_heads")
    vocab_size: int = Field(32000, gt=0, description="embedding table size (>= the tokenizer's vocabulary)")
    ffn_dim_multiplier: float = Field(1.0, gt=0, description="scales the Llama-style FFN width")
    ffn_hidden_dim: int | None = Field(None, gt=0, description="explicit FFN width; overrides the computed one")
    norm_type: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = Field(1e-5, gt=0)
    activation: Literal["silu", "gelu", "relu"] = Field(
        "silu", description="gate non-linearity of the gated MLP: silu = SwiGLU, gelu = GeGLU, relu = ReGLU"
    )
    max_seq_len: int = Field(2048, gt=0, description="length of the RoPE table; train.seq_len must not exceed it")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE frequency base")
    tie_embeddings: bool = Field(False, description="share the embedding matrix with the output head")
    qk_norm: bool = Field(False, description="RMSNorm over each head's queries and keys before RoPE")
    init_std: float = Field(0.02, gt=0, description="std of the normal weight init; output projections get init_std/sqrt(2*n_layers)")
    model_type: Literal["transformer"] = "transformer"
    sdpa_backend: Literal["auto", "math", "flash", "efficient", "cudnn"] = Field(
        "auto", description="restrict scaled_dot_product_attention to one kernel; auto lets PyTorch choose"
    )

    @model_validator(mode="after")
    def _shapes(self) -> "ModelConfig":
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = dim / n_heads = {self.head_dim} must be even for RoPE")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """FFN width: explicit, else 256 * ceil((8/3) * dim * ffn_dim_multiplier / 256)."""
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        return 256 * math.ceil((8 / 3) * self.dim * self.ffn_dim_multiplier / 256)
