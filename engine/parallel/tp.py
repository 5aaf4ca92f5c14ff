"""Tensor parallelism (Megatron-style, Shoeybi et al. 2019) with sequence parallelism, applied from outside.

The single-device `Transformer` is rewritten in place by `parallelize_module` with PyTorch's parallel styles;
the model code itself never sees a DTensor except as the tensors flowing through it. The plan:

- token embedding: vocabulary-sharded rows (as `RowwiseParallel` shards them), its output reduce-scattered
  over the sequence (`Shard(1)`, `SequenceShardedEmbedding`), so the residual stream between blocks is a plain
  tensor holding this rank's positions (each norm and each attention/MLP input rewraps it as a `Shard(1)`
  DTensor);
- the block norms and the final norm: `SequenceParallel` (each rank normalises its own positions; the norm
  weights are replicated and their gradients summed over the TP group by DTensor);
- attention and feed-forward: inputs all-gathered over the sequence (`PrepareModuleInput` Shard(1) → Replicate),
  wq/wk/wv and w1/w3 column-sharded (whole heads / hidden units per rank), wo and w2 row-sharded with a
  reduce-scatter back to the sequence-sharded residual stream. Attention therefore sees n_heads/tp query heads
  and n_kv_heads/tp key/value heads, contiguous in the same grouping as on one device;
- QK-norm (over head_dim) sees head-sharded plain tensors: its weight is replicated and the input is treated as
  sharded on the head dimension, so the weight's gradient is the sum over all heads as on one device;
- output head: column-sharded over the vocabulary. With loss parallel its logits stay vocabulary-sharded
  (`Shard(-1)`), and cross-entropy (inside `loss_context(True)`) never gathers them; otherwise they are
  all-gathered into plain full logits.

Tied embeddings are supported: the embedding and the head both shard the shared [vocab, dim] weight on dim 0,
so after the plan the head's weight is pointed at the embedding's DTensor parameter again.

MoE blocks: attention and norms as above. The MoE layer's input is all-gathered over the sequence into a
plain tensor that every TP rank holds in full (`MoESequenceGather`), so routing, capacity, the auxiliary
losses and the router load are computed on all the layer's tokens, identically on every TP rank and exactly
as on one device (a per-rank routing over its sequence shard would change all of them). The router weight
stays a plain replicated parameter: every rank computes its full gradient from the same values. The shared
experts are column/row-sharded like a dense MLP, their output all-reduced back to the full tokens. The
routed experts are sharded within each expert over the hidden units, in engine/parallel/expert.py
(`shard_experts`, together with expert parallelism when ep > 1). The layer's output is then cut back to
this rank's sequence shard.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from engine.model.mlp import GatedMLP
from engine.model.moe import MoE
from engine.model.transformer import Block, Transformer

# Losses that work on vocabulary-sharded logits (they call F.cross_entropy on the model's output). The chunked
# loss projects the hidden states itself through `output.weight`: it gathers the head's full weight and the
# full hidden states, so it runs without loss parallel.
LOSS_PARALLEL_LOSSES = ("cross_entropy",)


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh, *, loss_parallel: bool) -> None:
    """Shard `model` over the 1-D `tp_mesh` in place. The model is on the meta device (the trainer fills the
    shards afterwards) or holds the same weights on every rank; every TP rank must receive the same batch. The caller checks that tp divides n_heads, n_kv_heads, the FFN width and
    the sequence length (the vocabulary may shard unevenly). MoE layers' routed experts are left to
    `engine.parallel.expert.shard_experts`.
    With `loss_parallel`, the forward returns vocabulary-sharded DTensor logits and the loss and its backward
    must run inside `loss_context(True)`; the loss is then a replicated DTensor (`.item()` works)."""
    plan = {  # a pipeline stage has only some of these
        "tok_embeddings": SequenceShardedEmbedding(),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    parallelize_module(
        model, tp_mesh, {name: style for name, style in plan.items() if getattr(model, name) is not None}
    )
    for block in model.layers.values():
        parallelize_block(block, tp_mesh)
    if model.cfg.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        # Each style swapped in its own DTensor for the shared weight; both are Shard(0) of the same tensor.
        # (A pipeline stage holds one of the two: engine/parallel/pipeline.py keeps the copies in step.)
        model.output.weight = model.tok_embeddings.weight


def parallelize_block(block: Block, tp_mesh: DeviceMesh) -> None:
    """Attention and MLP over TP, norms over the sequence: two all-gathers and two reduce-scatters per block."""
    gather_sequence = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if isinstance(block.feed_forward, MoE):
        feed_forward = moe_plan(block.feed_forward)
    else:
        assert isinstance(block.feed_forward, GatedMLP)
        feed_forward = {
            "feed_forward": gather_sequence,
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
    parallelize_module(
        block,
        tp_mesh,
        {
            "attention_norm": SequenceParallel(),
            # (x, cos, sin, cache): only x is sharded; the RoPE tables are plain tensors every rank holds in full.
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            **feed_forward,
        },
    )
    attention = block.attention
    if attention.q_norm is not None:
        # q and k are [batch, seq, local heads, head_dim] plain tensors: dimension 2 is the sharded one.
        head_sharded = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(attention, tp_mesh, {"q_norm": head_sharded, "k_norm": head_sharded})


def moe_plan(moe: MoE) -> dict[str, ParallelStyle]:
    """The MoE layer on full tokens (see the module docstring); shared experts sharded like a dense MLP, their
    plain full input replicated in and their output all-reduced to the full tokens again."""
    plan: dict[str, ParallelStyle] = {"feed_forward": MoESequenceGather(), "feed_forward.router": ReplicatedRouter()}
    if moe.shared is not None:
        plan |= {
            "feed_forward.shared.w1": ColwiseParallel(),
            "feed_forward.shared.w3": ColwiseParallel(),
            "feed_forward.shared.w2": RowwiseParallel(output_layouts=Replicate()),
        }
    return plan


class SequenceShardedEmbedding(ParallelStyle):
    """The token embedding with vocabulary-sharded rows (`RowwiseParallel`), its partial sums reduce-scattered
    over the sequence into this rank's positions, as a plain tensor, by a collective that has completed.

    Why not `RowwiseParallel(output_layouts=Shard(1))`: its reduce-scatter is asynchronous, and its output an
    `AsyncCollectiveTensor`. Handed to a compiled block (the first one), AOTAutograd (torch 2.13) treats it as
    a tensor subclass that does not require grad: the block's output is cut off from the embedding, which
    gets no gradient, and the backward fails in DTensor's redistribute (`'Tensor' object has no attribute
    '_local_tensor'`). The first consumer (the block's norm) waits for the collective at once anyway."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, self.shard_rows, input_fn=self.replicate_tokens, output_fn=self.scatter_sequence
        )

    def shard_rows(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        """The [vocab, dim] weight's rows, scattered from `src_data_rank` as the built-in styles do."""
        for key, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            module.register_parameter(key, nn.Parameter(sharded, requires_grad=param.requires_grad))

    @staticmethod
    def replicate_tokens(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return (DTensor.from_local(inputs[0], mesh, [Replicate()], run_check=False), *inputs[1:])

    @staticmethod
    def scatter_sequence(module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        # The lookup's output holds each rank's rows' partial sums; a synchronous reduce-scatter.
        return output.redistribute(mesh, [Shard(1)]).to_local()


class MoESequenceGather(ParallelStyle):
    """An MoE layer between sequence-parallel norms: its input (this rank's sequence shard) all-gathered into
    the full plain tensor, its output (identical on every TP rank) cut back to this rank's shard.

    The gradients follow DTensor's rules for replicated values: the output's gradient is all-gathered from
    the ranks' shards (each rank then computes the full, identical gradient), and the input's is this rank's
    slice of it, with no sum (every rank already holds the whole)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # Hooks only, not distribute_module: that would make every parameter it leaves plain a replicated
        # DTensor, the router's and the experts' included (the plan's other entries and shard_experts shard them).
        module.register_forward_pre_hook(partial(self.gather, mesh=device_mesh))
        module.register_forward_hook(partial(self.scatter, mesh=device_mesh))
        return module

    @staticmethod
    def gather(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        return (x.redistribute(mesh, [Replicate()]).to_local(), *inputs[1:])

    @staticmethod
    def scatter(module: nn.Module, inputs: tuple, outputs: tuple, mesh: DeviceMesh) -> tuple:
        out, stats = outputs
        full = DTensor.from_local(out, mesh, [Replicate()], run_check=False)
        return full.redistribute(mesh, [Shard(1)]).to_local(), stats


class ReplicatedRouter(ParallelStyle):
    """The router's gate weight as a DTensor replicated over the TP ranks (so that the optimizer sees only
    DTensors, as fused and foreach kernels need), computed with as its local tensor, passed to the router's
    forward by a pre-hook like the experts' weights. Every rank computes the same full gradient from the same
    tokens, which the Replicate placement states without a collective."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module.gate, device_mesh)  # its one parameter, replicated
        module.register_forward_pre_hook(self.local_weight)
        return module

    @staticmethod
    def local_weight(module: nn.Module, inputs: tuple) -> tuple:
        return (inputs[0], module.gate.weight.to_local())


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Wrap forward + loss + backward in this when TP runs with loss parallel: F.cross_entropy on
    vocabulary-sharded logits then reduces the softmax over ranks instead of gathering the logits."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def uses_loss_parallel(tp: int, loss_fn: str, pp: int = 1) -> bool:
    """Loss parallel pays whenever there is TP and the loss takes the logits from the model; not under pipeline
    parallelism, whose schedule computes the loss itself and hands plain tensors between stages."""
    return tp > 1 and pp == 1 and loss_fn in LOSS_PARALLEL_LOSSES
