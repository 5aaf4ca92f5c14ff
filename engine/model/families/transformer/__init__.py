"""The decoder-only transformer family (`model_type = "transformer"`): Llama-style blocks (RMSNorm or
LayerNorm, RoPE with optional linear or llama3 scaling, grouped-query attention with optional QK-norm, q/k/v
biases, its own head width and a sliding window, a gated MLP or a mixture of experts), with its Hugging Face
counterparts Llama, Qwen3, Qwen2, Mistral, Qwen2-MoE, Qwen3-MoE and GLM-4-MoE.

The module itself is engine/model/transformer.py (its attention, MLP, MoE and norms are the shared
components in engine/model/); this folder holds what the rest of Forge needs to know of it: parameter
shapes and FLOPs (`shapes.py`), saved activations (`activations.py`), the tensor-parallel plan
(`tp_plan.py`) and the Hugging Face mapping (`hf.py`). Torch-free.
"""

from __future__ import annotations

from engine.config.model import ModelConfig
from engine.config.registry import MODELS
from engine.model.families.transformer import activations, config, hf, shapes, tp_plan
from engine.model.spec import ModelParts, ModelSpec


def rope_width(cfg: ModelConfig) -> int:
    """RoPE's cos and sin tables are [positions, head_dim]."""
    return cfg.head_dim


SPEC = ModelSpec(
    build="engine.model.transformer:Transformer",
    param_specs=shapes.param_specs,
    param_counts=shapes.param_counts,
    flops_per_token=shapes.training_flops_per_token,
    block_activation_bytes=activations.block_activation_bytes,
    checkpointed_block_bytes=activations.checkpointed_block_bytes,
    norm_bytes=activations.norm_bytes,
    position_table_width=rope_width,
    parts=ModelParts(
        blocks="layers",
        first=("tok_embeddings",),
        last=("norm", "output"),
        embedding="tok_embeddings",
        head="output",
        tied=("tok_embeddings", "output"),
        mtp="mtp",
        attention="attention.core",
        experts="feed_forward.experts",
        router="feed_forward.router",
        compile_regions=("attention", "feed_forward.router", "feed_forward.shared"),
        high_precision=("*.router.*",),  # the gate runs in fp32 through F.linear on its weight
    ),
    tp_plan=tp_plan.PLAN,
    hf=hf.MAPPING,
    head_extra_bytes=activations.mtp_bytes,
)

MODELS.register("transformer", spec=SPEC)(config.TransformerConfig)
