"""The GPT-2 family (`model_type = "gpt2"`): LayerNorm with bias, a bias in every linear, learned absolute
position embeddings, a non-gated GELU (tanh) MLP, the head tied to the token embedding; its Hugging Face
counterpart is GPT2LMHeadModel, both ways.

The module is `model.py`; this folder also holds what the rest of Forge needs to know of it: parameter shapes
and FLOPs (`shapes.py`), saved activations (`activations.py`), the tensor-parallel plan (`tp_plan.py`), the
Hugging Face mapping (`hf.py`) and its `[model]` config class (`config.py`: the shared fields only). Torch-free but for
`model.py`, which only building a model imports.
"""

from __future__ import annotations

from engine.config.registry import MODELS
from engine.model.families.gpt2 import activations, config, hf, shapes, tp_plan
from engine.model.spec import ModelParts, ModelSpec

SPEC = ModelSpec(
    build="engine.model.families.gpt2.model:GPT2",
    param_specs=shapes.param_specs,
    param_counts=shapes.param_counts,
    flops_per_token=shapes.training_flops_per_token,
    block_activation_bytes=activations.block_activation_bytes,
    checkpointed_block_bytes=activations.checkpointed_block_bytes,
    norm_bytes=activations.norm_bytes,
    position_table_width=lambda cfg: 0,  # learned positions: no per-position tables to copy per sequence
    parts=ModelParts(
        blocks="layers",
        first=("tok_embeddings", "pos_embeddings"),
        last=("norm", "output"),
        embedding="tok_embeddings",
        head="output",
        tied=("tok_embeddings", "output"),
        attention="attention.core",
    ),
    tp_plan=tp_plan.PLAN,
    hf=hf.MAPPING,
    lora_adapters=False,  # every GPT-2 linear has a bias, which model/lora.py's adapters do not keep
)

MODELS.register("gpt2", spec=SPEC)(config.GPT2Config)
