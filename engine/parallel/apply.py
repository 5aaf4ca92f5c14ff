"""Apply training transformations to a single-device `Transformer`, in a fixed order.

The full order is TP → EP → FP8 → activation checkpointing → compile → FSDP2. Only the stages a single
process needs exist so far; the others are rejected by config validation until they do.
Activation checkpointing wraps each block *before* compile so that the compiled graph contains the
recomputation instead of the checkpoint wrapper breaking the graph.
"""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from engine.config.job import JobConfig
from engine.model.transformer import Transformer


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


def parallelize(model: Transformer, cfg: JobConfig) -> Transformer:
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    if cfg.train.compile_model:
        apply_compile(model)
    return model
