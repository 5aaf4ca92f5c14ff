"""Apply training transformations to a single-device `Transformer`, in a fixed order.

The full order is TP → EP → FP8 → activation checkpointing → compile → FSDP2. Only the stages a single
process needs exist so far; the others are rejected by config validation until they do.
Activation checkpointing wraps each block *before* compile so that the compiled graph contains the
recomputation instead of the checkpoint wrapper breaking the graph.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from engine.config.job import JobConfig
from engine.errors import UserError
from engine.model.transformer import Transformer
from engine.train import precision


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """`full`: every block's activations are recomputed in backward; only block inputs are kept."""
    if mode == "none":
        return
    assert mode == "full", f"activation_checkpointing={mode!r} should have been rejected by config validation"
    for name, block in model.layers.named_children():
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: Transformer) -> None:
    """Compile block by block: blocks are identical, so one compiled graph is reused n_layers times."""
    for block in model.layers.values():
        block.compile(fullgraph=True)


def check_compilable(model: Transformer, cfg: JobConfig) -> None:
    """Compiled grouped_mm (MoE experts) only has a bf16 kernel: an MoE model compiles only under bf16."""
    device = model.tok_embeddings.weight.device
    dtype = precision.compute_dtype(cfg.train.mixed_precision, device)
    if cfg.model.is_moe and dtype != torch.bfloat16:
        raise UserError(f"train.compile_model = true with an MoE model (model.num_experts = {cfg.model.num_experts}) "
                        f"needs bf16 compute, but train.mixed_precision resolves to {str(dtype).removeprefix('torch.')} "
                        "here: torch.compile's grouped matrix multiply supports only bf16",
                        "set train.mixed_precision = \"bf16\", or train.compile_model = false")


def parallelize(model: Transformer, cfg: JobConfig) -> Transformer:
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    if cfg.train.compile_model:
        check_compilable(model, cfg)
        apply_compile(model)
    return model
