"""What a mixture-of-experts model needs in a pipeline: its routers' auxiliary losses trained on every stage,
and its routing metrics gathered from every stage.

Auxiliary losses. On one device the training loss of a micro-batch is cross-entropy + the weighted
auxiliary losses of all MoE layers (the model's `moe_loss()`, engine/train/losses.py), divided by the
number of micro-batches. In a pipeline each stage's layers produce their part of the auxiliary losses, but
the schedule computes a loss (and starts backward) only on the last stage. So each stage carries its
layers' auxiliary loss on its output (`carry_aux_loss`, Megatron's MoEAuxLossAutoScaler idea): an autograd
function that is the identity in forward and, in backward, besides passing the output's gradient through,
gives the auxiliary loss the gradient 1 — its coefficient in the micro-batch's loss. The schedule then
divides every gradient of the stage by the number of micro-batches, as it does for cross-entropy's, which
is the 1 / grad_accum_steps of one process. The routers' gradients are therefore one process's.

The logged loss is one process's too: each rank adds the mean over micro-batches of its stages'
auxiliary losses (`StageAuxLosses.mean`) to its share, and `Pipeline.step_loss` sums the shares.

Metrics. `moe_metrics` reports the last forward's routing of each MoE layer. A pipeline rank holds only its
stages' layers, so every rank gathers the others' rows (`pipeline_moe_metrics`), and rank 0 logs all the
layers' rows, with the totals over all of them, exactly as one process does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.model.routing_metrics import moe_layer_metrics, with_moe_totals


class CarryAuxLoss(torch.autograd.Function):
    """Identity on `output`; in backward the auxiliary loss `aux` (a scalar with gradient) gets gradient 1."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


def carry_aux_loss(output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    return CarryAuxLoss.apply(output, aux)


class StageAuxLosses:
    """Attached to this rank's stage modules (`attach`): after each training forward of a stage, its
    layers' auxiliary loss rides on its output, and its value is kept for the logged loss."""

    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []

    def attach(self, part: nn.Module) -> None:
        part.register_forward_hook(self.carry)

    def carry(self, part: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        """Forward hook: evaluation (no gradient) neither trains nor reports the auxiliary losses."""
        aux = part.moe_loss()
        if aux is None or not (part.training and torch.is_grad_enabled()):
            return None
        self.values.append(aux.detach())
        return carry_aux_loss(output, aux)

    def mean(self, n_microbatches: int, device: torch.device) -> torch.Tensor:
        """The mean over the step's micro-batches of this rank's stages' auxiliary losses; starts the next
        step's count."""
        total = torch.stack([v.float() for v in self.values]).sum() if self.values else torch.zeros((), device=device)
        self.values = []
        return total / n_microbatches


def pipeline_moe_metrics(
    parts: list[nn.Module],
    gather: Callable[[dict[str, float]], dict[str, float]],
    windows: dict[str, torch.Tensor] | None = None,
) -> dict[str, float]:
    """`moe_metrics` of the whole pipelined model, on every rank of the pipeline (a collective): each rank's
    stages' layer rows, merged by `gather` (`Pipeline.gather`), in layer order, with the totals over all
    layers. `windows`: this rank's layers' tokens per expert since the last report (the dead experts)."""
    mine: dict[str, float] = {}
    for part in parts:
        mine.update(moe_layer_metrics(part, windows))
    rows = gather(mine)
    ordered = sorted(rows, key=lambda key: int(key.split("/")[1]))
    return with_moe_totals({key: rows[key] for key in ordered})
