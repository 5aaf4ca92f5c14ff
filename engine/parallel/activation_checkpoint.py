"""Activation checkpointing: trade backward-pass recomputation for activation memory, block by block.

Three modes (`train.activation_checkpointing`):

- `none`: autograd keeps every tensor the backward needs.
- `full`: each block (the family's `ModelParts.blocks`) keeps only its input; the whole block forward runs again in backward.
  Least memory, about one extra forward of compute (~33% more per step).
- `selective`: an op-level policy (`torch.utils.checkpoint.create_selective_checkpoint_contexts`) decides,
  op by op inside each block, whether its output is kept from the forward or recomputed in backward:

  kept (`SAVED_OPS`): the ops whose recomputation would cost real compute or communication —
    * matrix multiplies (`mm`, `addmm`, `bmm`, fp8 `_scaled_mm`, the MoE experts' `_grouped_mm`): O(d)
      FLOPs per output element, the bulk of a block's compute;
    * attention kernels (every `scaled_dot_product_attention` variant): O(seq) work per output element;
    * collectives that reduce or exchange data (`all_reduce`, `reduce_scatter_tensor`, `all_to_all_single`,
      from tensor and expert parallelism): recomputing them would repeat communication on the critical
      path of backward. All-gathers are recomputed: their output is tp times larger than their input;
    * `max`/`amax` reductions: fp8 scaling takes the absolute max of each tensor it casts; the result
      is a scalar (or one value per row), so keeping it costs nothing and saves a full read of the tensor;
    * the MoE routing decisions, `topk` ([tokens, k] indices): tiny, and what keeps a recomputed block
      routing as its forward did.
  recomputed: everything else — norms (upcasts, mean of squares, rsqrt), activations (silu/gelu/relu)
    and the gated product, RoPE, residual adds, reshapes, autocast's low-precision copies of the weights,
    and the MoE router's top-k, sort and counts. These are elementwise or cheap, memory-bound ops whose
    outputs (several [tokens, dim] and two [tokens, ffn_dim] tensors per block) are a large share of the
    activations `none` keeps, while recomputing them costs a few percent of a step.

  Every matmul is kept rather than every other one: selective then never repeats a matmul, so it costs
  little more than `none` (the pointwise ops) while still dropping the elementwise activations; `full`
  remains the mode for minimum memory. An op-level policy sees ops, not their consumers, so the outputs of
  the two projections that only feed the residual add (attention `wo`, MLP `w2`) are kept as well.

Both checkpointing modes are exact: the recomputation runs the same ops on the same inputs, so losses and
gradients equal `none`'s. The block has no randomness (no dropout), hence `preserve_rng_state=False`.
MoE blocks return (output, routing stats); the stats and aux losses come from the original forward, and the
recomputation's copies are discarded, so nothing is counted twice. The sigmoid router's balancing bias is
changed only between training forwards (by hooks on the whole model, engine/train/balancing.py), so the
recomputation routes exactly as the forward did. Not so in a pipeline stage, which may run later forwards before
an earlier backward: there `selective` stays exact (it keeps `topk`'s output) and `full` is refused.

Wrapping happens before `torch.compile` (engine.parallel.apply): the compiled graph then contains the
recomputation, and compile applies the same policy when it partitions forward and backward. Use selective
with compile: in eager mode the policy runs as a Python dispatch mode on every op, whose overhead made an
eager selective step slower than a full one on an H100 (torch 2.11; 8 layers, dim 1024, 8 × 2048 tokens, bf16: none
51 ms / 8.7 GiB, full 65 ms / 3.4 GiB, selective 97 ms / 5.9 GiB); compiled, selective costs 4% over none
(none 33.9 ms / 7.0 GiB, full 41.8 ms / 3.8 GiB, selective 35.2 ms / 5.7 GiB).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from engine.model.spec import LanguageModel, spec_for

AC_MODES = ("none", "full", "selective")


def _saved_ops() -> frozenset:
    """The op overloads whose outputs the selective policy keeps (see the module docstring)."""
    aten = torch.ops.aten
    ops = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_mm.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten.max.default,
        aten.amax.default,
        aten.topk.default,
    }
    if hasattr(aten, "_grouped_mm"):
        ops.add(aten._grouped_mm.default)
    if torch.distributed.is_available():
        c10d = torch.ops._c10d_functional
        ops |= {c10d.all_reduce.default, c10d.reduce_scatter_tensor.default, c10d.all_to_all_single.default}
    return frozenset(ops)


SAVED_OPS = _saved_ops()


def selective_policy(ctx: object, op: torch._ops.OpOverload, *args: object, **kwargs: object) -> CheckpointPolicy:
    """Keep the outputs of `SAVED_OPS`, recompute everything else. PREFER_RECOMPUTE (not MUST) lets
    torch.compile's partitioner keep a recomputable value when that is cheaper inside a fused graph."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """A fresh pair of policy contexts for each checkpointed call (checkpoint's `context_fn`)."""
    return create_selective_checkpoint_contexts(selective_policy)


def apply_activation_checkpointing(model: LanguageModel, mode: str) -> None:
    """Wrap every block of `model` in place for `mode` (none | full | selective).

    Blocks are wrapped one by one so that each block's recomputation happens just before its own backward,
    and the wrapped modules keep their parameter names' suffixes (checkpoint_wrapper's prefix is removed
    from state dicts), so checkpoints load into an unwrapped model."""
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpointing must be one of {', '.join(AC_MODES)}, not {mode!r}")
    if mode == "none":
        return
    extra = {"context_fn": selective_context} if mode == "selective" else {}
    blocks = getattr(model, spec_for(model.cfg).parts.blocks)  # the family's blocks
    for name, block in blocks.named_children():
        blocks[name] = checkpoint_wrapper(block, preserve_rng_state=False, **extra)
