"""Auxiliary-loss-free load balancing during training: the balancing bias of `sigmoid_topk` routers
(engine/model/routers.py), updated from each training forward's tokens per expert by hooks that training
attaches to the model from outside (`attach_router_balancing`). The model's forward has no such side effect.

When the update happens, and why hooks on the model's forward rather than an optimizer step pre-hook (which
torchtitan uses for the same balancing): the bias moves once per training forward, i.e. per micro-batch, and
only between forwards. The load of micro-batch i is recorded at the end of its forward and applied at the start
of the next training forward (micro-batch i+1, or the first one of the next step), after micro-batch i's
backward has finished, so the recomputation of its blocks under activation checkpointing routes exactly as the
forward did. An optimizer step pre-hook fires once per step: with `train.grad_accum_steps > 1` it would apply
one micro-batch's load where today every micro-batch applies its predecessor's, and change the numbers.
Applying the load right after a backward instead would show evaluation (between steps) and the metrics a bias
the next training forward has not used yet. Hooks on the root module fire once per forward call, never for the
recomputed blocks; forwards without gradient or in eval mode (evaluation, generation) neither apply nor record.

Under pipeline parallelism the hooks sit on each stage (engine/train/job.py), whose routers see the same
micro-batches in the same order as on one device. A stage may run micro-batch i+1's forward before micro-batch
i's backward (1F1B, GPipe): the bias has then moved before that backward, which is harmless when the backward
does not route again (no checkpointing, or selective checkpointing, which keeps the routing decisions) and
wrong under full checkpointing, which config validation therefore refuses there.

Under data parallelism each rank's recorded load is summed over the data-parallel group right after it is
recorded (`all_reduce_router_load`), before any checkpoint can save it, so every rank applies the same update.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn


def attach_router_balancing(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Update the balancing bias of `model`'s routers (a model with experts, `LanguageModel`, with whatever parallelism it has) per
    training forward; `group`: the data-parallel ranks whose loads are summed. Attach once, after the
    model is parallelized (FSDP's own forward hooks then run first, as they did around the old in-forward
    update; they touch parameters, not the routers' buffers)."""
    model.register_forward_pre_hook(apply_pending_load)
    model.register_forward_hook(partial(record_load, group=group))


def training_forward(model: nn.Module) -> bool:
    return model.training and torch.is_grad_enabled()


def apply_pending_load(model: nn.Module, args: tuple) -> None:
    """Forward pre-hook: each balancing router applies the load of the previous training forward."""
    if not training_forward(model):
        return
    for router in model.moe_routers().values():
        if hasattr(router, "apply_bias_update"):
            router.apply_bias_update()


def record_load(model: nn.Module, args: tuple, output: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Forward hook: each balancing router keeps this training forward's load (summed over `group`) until
    the next training forward applies it."""
    if not training_forward(model):
        return
    for name, router in model.moe_routers().items():
        if hasattr(router, "record_load"):
            router.record_load(model.last_moe_stats[name].load)
    if group is not None:
        all_reduce_router_load(model, group)


def all_reduce_router_load(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Sum the pending load of every balancing-bias router (sigmoid_topk) over the data-parallel `group`, so
    that every rank applies the same bias update, computed from the load of the global batch as a single
    process would. Without it each rank's bias follows its own data, the ranks' models drift apart, and a
    checkpoint (which keeps rank 0's buffers) resumes the others with the wrong bias. Call after a training
    forward has recorded its load, before the next one applies it (with or without expert parallelism)."""
    for router in model.moe_routers().values():
        if hasattr(router, "pending_load"):
            dist.all_reduce(router.pending_load, group=group)
