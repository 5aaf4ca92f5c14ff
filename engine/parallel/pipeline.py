"""Pipeline parallelism: the model cut into stages by layer, run by a `torch.distributed.pipelining` schedule.

Following torchtitan, every stage is a deep copy of the single-device `Transformer` with the blocks it does not
own deleted from `layers` and `tok_embeddings` / `norm` / `output` set to None where another stage owns them.
Parameter names therefore stay those of the full model, so checkpoints do not depend on the pipeline layout.

Stages are assigned to ranks in a loop: stage s runs on pipeline rank s % pp. `gpipe` and `1f1b` have one stage
per rank; `interleaved_1f1b` has two ("virtual stages"), so rank r runs stages r and r + pp, and the model is cut
into 2·pp stages.

Data: one optimizer step is one `Pipeline.step(inputs, labels)` with inputs [n_microbatches · batch, seq]; the
schedule splits it into `n_microbatches` microbatches (the trainer's `train.grad_accum_steps`), runs forward and
backward for all of them, and — as the schedules scale gradients by 1 / n_microbatches — leaves the gradients of
`Σ_i loss_fn(mb_i) / n_microbatches`, which is what gradient accumulation over the same microbatches gives.

Order of application: split first (`split_stages`), then each stage's module is parallelized on its own
(TP, activation checkpointing, compile, FSDP: `build_pipeline(parallelize_stage=…)`), then the schedule is built.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    _PipelineSchedule,
)

from engine.errors import UserError
from engine.model.transformer import Transformer
from engine.parallel.stages import stage_layers, stages_per_rank

SCHEDULES: dict[str, type[_PipelineSchedule]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}

# A loss on the last stage's output: (logits [batch, seq, vocab], labels [batch, seq]) → scalar mean loss.
StageLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def stage_layer_names(n_layers: int, n_stages: int) -> list[list[str]]:
    """The `layers` keys ("0", "1", …) each stage owns, in order."""
    return [[str(i) for i in layers] for layers in stage_layers(n_layers, n_stages)]


def stage_model(model: Transformer, stage: int, n_stages: int) -> Transformer:
    """A copy of `model` holding only what stage `stage` of `n_stages` runs (same parameter names)."""
    keep = set(stage_layer_names(model.cfg.n_layers, n_stages)[stage])
    part = copy.deepcopy(model)
    for name in list(part.layers):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != n_stages - 1:
        part.norm = None
        part.output = None
    return part


def split_stages(
    model: Transformer, pp_rank: int, pp_size: int, n_stages_per_rank: int
) -> list[tuple[int, Transformer]]:
    """(stage index, stage model) for every stage pipeline rank `pp_rank` runs: stages pp_rank + k·pp_size."""
    if model.cfg.tie_embeddings and pp_size > 1:
        raise UserError(
            "model.tie_embeddings = true cannot be pipelined: the embedding (first stage) and the "
            "output head (last stage) would live on different ranks",
            "set model.tie_embeddings = false, or distributed.pp = 1",
        )
    if model.cfg.is_moe and pp_size > 1:
        raise UserError(
            f"an MoE model (model.num_experts = {model.cfg.num_experts}) cannot be pipelined yet: its "
            "routers' auxiliary losses are computed on every stage but the pipeline loss exists only "
            "on the last one",
            "set distributed.pp = 1, or model.num_experts = 0",
        )
    n_stages = pp_size * n_stages_per_rank
    return [(stage, stage_model(model, stage, n_stages)) for stage in range(pp_rank, n_stages, pp_size)]


@dataclass
class Pipeline:
    """This rank's share of a pipelined model and the schedule that drives it.

    `model_parts` are the stage models this rank owns (for the optimizer, FSDP, checkpoints: their parameter
    names are the full model's); the loss exists only on the rank holding the last stage."""

    schedule: _PipelineSchedule
    model_parts: list[nn.Module]
    stages: list[PipelineStage]
    has_first_stage: bool
    has_last_stage: bool
    group: dist.ProcessGroup
    loss_fn: StageLoss  # what the schedule computes on the last stage

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward over all microbatches of one optimizer step; inputs and labels are
        [n_microbatches · batch, seq]. → the mean microbatch loss (detached) on the last stage's rank, else
        None. Gradients are left in the parts' .grad for the caller's clip and optimizer step. The schedule
        divides every .grad by n_microbatches at the end, so they must be zero (or None) before the call."""
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        target = labels if self.has_last_stage else None
        args = (inputs,) if self.has_first_stage else ()
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        if losses is None:
            return None
        return torch.stack([loss.detach() for loss in losses]).mean()

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Forward only over all microbatches ([n_microbatches · batch, seq], the schedule's own split); →
        the mean microbatch loss on the last stage's rank, else None."""
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        args = (inputs,) if self.has_first_stage else ()
        self.schedule.eval(*args, target=labels if self.has_last_stage else None, losses=losses, return_outputs=False)
        return None if losses is None else torch.stack(losses).mean()

    def broadcast_loss(self, loss: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """The step's loss on every pipeline rank (a collective: all ranks of the pipeline call it), from the
        rank holding the last stage, which is pipeline rank pp-1 under the loop placement."""
        value = loss.detach().float().reshape(()) if loss is not None else torch.zeros((), device=device)
        value = value.to(device).clone()
        dist.broadcast(value, group=self.group, group_src=self.group.size() - 1)
        return value


def build_pipeline(
    model: Transformer,
    pp_mesh: DeviceMesh,
    schedule: str,
    n_microbatches: int,
    loss_fn: StageLoss,
    device: torch.device,
    parallelize_stage: Callable[[Transformer], nn.Module] | None = None,
) -> Pipeline:
    """Cut `model` (the full single-device model, identical on every rank, possibly on the meta device) into
    this rank's stages, apply `parallelize_stage` to each (TP / AC / compile / FSDP — whatever the caller
    applies to a whole model otherwise), and build the schedule. `loss_fn` is the per-microbatch mean loss:
    the schedule divides gradients by `n_microbatches` itself."""
    pp_rank, pp_size = pp_mesh.get_local_rank(), pp_mesh.size()
    per_rank = stages_per_rank(schedule)
    check_microbatches(schedule, pp_size, n_microbatches)
    group = pp_mesh.get_group()
    n_stages = pp_size * per_rank
    parts, stages = [], []
    for index, part in split_stages(model, pp_rank, pp_size, per_rank):
        module = parallelize_stage(part) if parallelize_stage is not None else part
        parts.append(module)
        stages.append(PipelineStage(module, index, n_stages, device, group=group))
    schedule_class = SCHEDULES[schedule]
    runner = schedule_class(stages if per_rank > 1 else stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    indices = [stage.stage_index for stage in stages]
    return Pipeline(
        runner,
        parts,
        stages,
        has_first_stage=0 in indices,
        has_last_stage=n_stages - 1 in indices,
        group=group,
        loss_fn=loss_fn,
    )


def check_microbatches(schedule: str, pp_size: int, n_microbatches: int) -> None:
    """The microbatch counts torch's schedules accept (they raise deep inside otherwise): GPipe any; 1F1B at
    least pp; interleaved 1F1B, which runs microbatches in rounds of about pp, a multiple of the number of
    rounds max(1, n // pp) — any n < 2·pp, and any multiple of pp."""
    if schedule == "1f1b" and n_microbatches < pp_size:
        raise UserError(
            f"distributed.pp_schedule = '1f1b' needs train.grad_accum_steps (the pipeline "
            f"microbatches) >= distributed.pp = {pp_size}, got {n_microbatches}",
            f"set train.grad_accum_steps to at least {pp_size}",
        )
    rounds = max(1, n_microbatches // pp_size)
    if schedule == "interleaved_1f1b" and n_microbatches % rounds:
        raise UserError(
            f"distributed.pp_schedule = 'interleaved_1f1b' runs train.grad_accum_steps = "
            f"{n_microbatches} microbatches in {rounds} rounds (grad_accum_steps // distributed.pp), "
            "so it must be a multiple of that",
            f"set train.grad_accum_steps to a multiple of {pp_size}",
        )


def stage_union(parts: list[nn.Module]) -> nn.Module:
    """One module holding this rank's stage parts under the full model's names (the parts' own modules, not
    copies): what the optimizer and the checkpoints see, so a pipelined run's parameter groups and
    checkpoint keys are those of the unpipelined model, and a checkpoint moves between layouts."""
    union = nn.Module()
    union.layers = nn.ModuleDict()
    for part in parts:
        union.layers.update(part.layers)
        for name in ("tok_embeddings", "norm", "output"):
            if getattr(part, name) is not None:
                setattr(union, name, getattr(part, name))
    return union
