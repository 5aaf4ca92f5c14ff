"""Tensor parallelism (Megatron-style, Shoeybi et al. 2019) with sequence parallelism, applied from outside.

The plan is the model family's, as data (`ModelSpec.tp_plan`: module name → `TPStyle`, engine/model/spec.py);
this module makes PyTorch's parallel styles of it and rewrites the single-device model in place with
`parallelize_module`. The model code itself never sees a DTensor except as the tensors flowing through it.
What each style does:

- "vocab_embedding": the token embedding with vocabulary-sharded rows (as `RowwiseParallel` shards them), its
  output reduce-scattered over the sequence (`Shard(1)`, `SequenceShardedEmbedding`), so the residual stream
  between blocks is a plain tensor holding this rank's positions (each norm and each gathered input rewraps
  it as a `Shard(1)` DTensor);
- "sequence_parallel": `SequenceParallel` (each rank normalises its own positions; the norm weights are
  replicated and their gradients summed over the TP group by DTensor);
- "gather_sequence": `PrepareModuleInput` all-gathers the module's first input over the sequence (Shard(1) →
  Replicate); "colwise" / "rowwise": column- and row-sharded linears, the row-sharded one reduce-scattering
  back to the sequence-sharded residual stream (so attention sees whole heads per rank, an MLP whole hidden
  units); "rowwise_replicate": all-reduced to the full tokens instead;
- "head_sharded_norm": a norm over head_dim of head-sharded plain q or k: its weight is replicated and the
  input treated as sharded on the head dimension, so the weight's gradient is the sum over all heads as on
  one device;
- "head_sharded_vector": a module holding one value per query head (attention sinks) as `weight`: sharded
  on dim 0 over the TP ranks as wq shards the heads, the module's output being this rank's shard;
- "vocab_head": the output head, column-sharded over the vocabulary. With loss parallel its logits stay
  vocabulary-sharded (`Shard(-1)`), and cross-entropy (inside `loss_context(True)`) never gathers them;
  otherwise they are all-gathered into plain full logits;
- "full_tokens" (`FullTokens`): a module, such as an MoE layer, whose input (this rank's sequence shard) is
  all-gathered over the sequence into a plain tensor every TP rank holds in full, so routing, capacity, the
  auxiliary losses and the router load are computed on all the layer's tokens, identically on every TP rank
  and exactly as on one device; its output is cut back to this rank's shard. "replicated_router": a router
  weight as a replicated DTensor, computed with as its local tensor (every rank computes its full gradient
  from the same values). Routed experts are sharded in engine/parallel/expert.py (`shard_experts`, together
  with expert parallelism when ep > 1);
- "sequence_linear": a column-sharded linear between sequence-sharded tensors (a multi-token-prediction
  module's projection): input all-gathered over the sequence, output redistributed to this rank's positions.

Tied embeddings (`TPPlan.tied`): the embedding and the head both shard the shared [vocab, dim] weight on
dim 0, so after the plan the head's weight is pointed at the embedding's DTensor parameter again.
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

from engine.model.spec import TPStyle, spec_for

# Losses that work on vocabulary-sharded logits (they call F.cross_entropy on the model's output). The chunked
# loss projects the hidden states itself, through this rank's rows of `output.weight`: it is vocabulary-parallel
# on its own (engine/train/losses.py, `VocabShard`) and never calls the head module, whose layout is moot to it.
LOSS_PARALLEL_LOSSES = ("cross_entropy",)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool) -> None:
    """Shard `model` over the 1-D `tp_mesh` in place, as its family's plan says. The model is on the meta
    device (the trainer fills the shards afterwards) or holds the same weights on every rank; every TP rank
    must receive the same batch. The caller checks that tp divides what the plan shards (heads, the FFN
    width, the sequence length; the vocabulary may shard unevenly). Routed experts are left to
    `engine.parallel.expert.shard_experts`.
    With `loss_parallel`, the forward returns vocabulary-sharded DTensor logits and the loss and its backward
    must run inside `loss_context(True)`; the loss is then a replicated DTensor (`.item()` works)."""
    spec = spec_for(model.cfg)
    plan = spec.tp_plan
    outer = {  # a pipeline stage has only some of these
        name: parallel_style(style, loss_parallel)
        for name, style in plan.outer.items()
        if getattr(model, name, None) is not None
    }
    parallelize_module(model, tp_mesh, outer)
    for name, block in getattr(model, spec.parts.blocks).items():
        styles = {
            path: parallel_style(style, loss_parallel) for path, style in plan.block(model.cfg, int(name)).items()
        }
        parallelize_module(block, tp_mesh, styles)
    modules = getattr(model, "mtp", None)  # multi-token prediction (engine/model/mtp.py)
    if modules is not None:
        assert plan.mtp is not None, f"{model.cfg.model_type} has prediction modules but no tensor-parallel plan"
        styles = {path: parallel_style(style, loss_parallel) for path, style in plan.mtp(model.cfg).items()}
        for module in modules.values():
            parallelize_module(module, tp_mesh, styles)
    if plan.tied is not None and model.cfg.tie_embeddings:
        head, embedding = (getattr(model, name, None) for name in plan.tied)
        if head is not None and embedding is not None:
            # Each style swapped in its own DTensor for the shared weight; both are Shard(0) of the same tensor.
            # (A pipeline stage holds one of the two: engine/parallel/pipeline.py keeps the copies in step.)
            head.weight = embedding.weight


def parallel_style(style: TPStyle, loss_parallel: bool) -> ParallelStyle:
    """The DTensor style of one `TPStyle` of a family's plan (the kinds are described in the module docstring)."""
    kind = style.kind
    if kind == "gather_sequence":  # only the first input is sharded; the others pass as they are
        rest = (None,) * (style.inputs - 1)
        return PrepareModuleInput(input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest))
    if kind == "vocab_head":
        return ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return STYLES[kind]()


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


class FullTokens(ParallelStyle):
    """A module (an MoE layer) between sequence-parallel norms: its input (this rank's sequence shard)
    all-gathered into the full plain tensor, its output (identical on every TP rank; a tensor, or a tuple whose
    first item is the tensor and the rest pass through, as an MoE layer's routing stats) cut back to this
    rank's shard.

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
    def scatter(module: nn.Module, inputs: tuple, outputs: torch.Tensor | tuple, mesh: DeviceMesh) -> object:
        out, rest = (outputs[0], outputs[1:]) if isinstance(outputs, tuple) else (outputs, None)
        full = DTensor.from_local(out, mesh, [Replicate()], run_check=False)
        local = full.redistribute(mesh, [Shard(1)]).to_local()
        return local if rest is None else (local, *rest)


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


class HeadShardedVector(ParallelStyle):
    """A per-head vector (`module.weight`, [n_heads]) as a Shard(0) DTensor over the TP ranks, whose module
    returns it: the output is made this rank's local shard, the logits of the heads its wq computes (DTensor
    sums nothing: each rank's gradient is its own heads')."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self.shard_heads, output_fn=self.local)

    def shard_heads(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name == "":
            sharded = distribute_tensor(module.weight, mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            module.register_parameter("weight", nn.Parameter(sharded))

    @staticmethod
    def local(module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local()


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Wrap forward + loss + backward in this when TP runs with loss parallel: F.cross_entropy on
    vocabulary-sharded logits then reduces the softmax over ranks instead of gathering the logits."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def uses_loss_parallel(tp: int, loss_fn: str, pp: int = 1) -> bool:
    """Loss parallel pays whenever there is TP and the loss takes the logits from the model; not under pipeline
    parallelism, whose schedule computes the loss itself and hands plain tensors between stages."""
    return tp > 1 and pp == 1 and loss_fn in LOSS_PARALLEL_LOSSES


STYLES: dict[str, type[ParallelStyle] | partial] = {
    "colwise": ColwiseParallel,
    "rowwise": partial(RowwiseParallel, output_layouts=Shard(1)),
    "rowwise_replicate": partial(RowwiseParallel, output_layouts=Replicate()),
    "sequence_parallel": SequenceParallel,
    "head_sharded_norm": partial(SequenceParallel, sequence_dim=2, use_local_output=True),
    "head_sharded_vector": HeadShardedVector,
    "vocab_embedding": SequenceShardedEmbedding,
    "full_tokens": FullTokens,
    "replicated_router": ReplicatedRouter,
    # output Shard(-1) → Shard(1): one redistribution back to the sequence-sharded stream the block reads
    "sequence_linear": partial(ColwiseParallel, input_layouts=Shard(1), output_layouts=Shard(1)),
}
"""The styles made the same way whatever the call (the kinds of engine.model.spec.TP_KINDS but the two
`parallel_style` builds from the style's arguments or the loss)."""
