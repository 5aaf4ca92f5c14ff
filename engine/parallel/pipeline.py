"""Pipeline parallelism: the model cut into stages by layer, run by a `torch.distributed.pipelining` schedule.

Following torchtitan, every stage is a deep copy of the single-device model with the blocks it does not own
deleted and its first or last modules set to None where another stage owns them, as the model family's
`ModelParts` names them (engine/model/spec.py; the transformer's: blocks in `layers`, first `tok_embeddings`,
last `norm` and `output`).
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

Tied embeddings: the first stage holds the embedding and the last the head, each its own copy of the one
shared matrix (same name as in the full model's state dict: `tok_embeddings.weight`, `output.weight`). Both
copies start equal, and after every step's backward their gradients are summed between the two ranks
(`TiedWeight.sync`), so each holds the gradient one device computes for the shared matrix and the same
optimizer update keeps them equal. The gradient norm counts it once (`Pipeline.norm_duplicates`).

Multi-token prediction (`model.mtp_depth` = D, engine/model/mtp.py): the prediction modules run on the last
stage, after the head, and look up the tokens ahead in the embedding, so the last stage keeps a copy of the
embedding too (the family's `ModelParts.mtp`), kept equal to the first stage's as a tied head is (with tied
embeddings the last stage's embedding and head share that one copy). They need the window's token ids,
which the last stage does not receive: every rank holds the step's batch anyway and hands it to the schedule
as a keyword argument (`mtp_tokens`), split into micro-batches like packed windows' document ids. A stage
sends one tensor, so the last stage's forward hook (`send_predictions`) concatenates the main output and
the D modules' whole-window outputs along the batch: [(1 + D) · batch, seq, vocab or dim]
(`StageShapes.predictions`); the loss splits them again (engine/train/losses.py, `StageCrossEntropy`).
Evaluation runs the main model alone (no token ids passed: the last stage sends [batch, seq, ·]).

Shapes: every stage is told up front what it receives and sends for one micro-batch (`StageShapes`), so the
schedule's first step does not run each stage once on placeholder inputs to learn them (torch's metadata
inference). That pass is a training forward and backward: it would move the MoE routers' balancing bias
(engine/train/balancing.py) and, on a later stage, route uninitialised memory. A forward hook checks every
stage's output against what was declared.

Chunked cross-entropy (`StageShapes.last_hidden`): the last stage returns its final-normed hidden states
[batch, seq, dim] instead of logits, and the loss projects them through that stage's head chunk by chunk
(engine/train/losses.py, `StageCrossEntropy`). Every stage's forward is then called with `return_hidden=True`
(the schedule hands keyword arguments to every stage; the others return their blocks' output either way).

Mixture of experts: each stage's routers' auxiliary losses ride on its output to the schedule's backward,
and the logged loss and routing metrics cover every stage (engine/parallel/pipeline_moe.py).

Packed documents (data.pack_sequences): every stage's attention needs the windows' document ids (the mask and
the RoPE positions restarting per document, engine/model/documents.py). They are not sent between stages:
every pipeline rank holds the step's whole batch of token ids anyway and derives the same ids from it, and
hands them to the schedule as a keyword argument (`Pipeline.step(..., doc_ids=)`), which torch's schedules
split into micro-batches like the inputs and pass to each of this rank's stages (`forward(..., doc_ids=)`).
Stage inputs and outputs, and so `StageShapes`, stay as without packing; the ids take no gradient (torch
keeps keyword tensors out of the gradients a stage sends back). Under tensor parallelism they stay
full-length [batch, seq] as without a pipeline: attention runs on the whole sequence after the gather.
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
from torch.distributed.tensor import DTensor

from engine.errors import UserError
from engine.model.spec import spec_for
from engine.parallel.pipeline_moe import StageAuxLosses
from engine.parallel.stages import stage_layers, stages_per_rank

SCHEDULES: dict[str, type[_PipelineSchedule]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}

# A loss on the last stage's output: (logits [batch, seq, vocab], labels [batch, seq]) → scalar mean loss.
StageLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StageShapes:
    """What the stages pass for one micro-batch: token ids [batch, seq] into the first stage, hidden states
    [batch, hidden_seq, dim] between stages (hidden_seq = seq / tp: the residual stream is sequence-sharded
    under tensor parallelism), full logits [batch, seq, vocab] out of the last, or with `last_hidden` (a loss
    that projects them itself) its final-normed hidden states [batch, seq, dim], in the residual's dtype.
    With `predictions` D > 0 (multi-token prediction) a training forward's last stage sends (1 + D)·batch
    rows: the main output, then each module's; evaluation runs the main model alone."""

    batch: int
    seq: int
    hidden_seq: int
    dim: int
    vocab: int
    hidden_dtype: torch.dtype  # the residual stream's: fp32 under autocast, the compute dtype under FSDP
    logits_dtype: torch.dtype
    last_hidden: bool = False
    predictions: int = 0  # multi-token-prediction modules, whose outputs follow the main one's along the batch

    def inputs(self, stage: int) -> torch.Tensor:
        """The example input of `stage` (on the meta device: only its shape, dtype and requires_grad count)."""
        if stage == 0:
            return torch.empty(self.batch, self.seq, dtype=torch.int64, device="meta")
        return self.hidden().requires_grad_()

    def outputs(self, stage: int, n_stages: int, training: bool = True) -> torch.Tensor:
        rows = (1 + self.predictions if training else 1) * self.batch  # the last stage's: main, then each module's
        if stage == n_stages - 1 and self.last_hidden:
            shape = (rows, self.seq, self.dim)
            return torch.empty(shape, dtype=self.hidden_dtype, device="meta").requires_grad_()
        if stage == n_stages - 1:
            shape = (rows, self.seq, self.vocab)
            return torch.empty(shape, dtype=self.logits_dtype, device="meta").requires_grad_()
        return self.hidden().requires_grad_()

    def hidden(self) -> torch.Tensor:
        return torch.empty(self.batch, self.hidden_seq, self.dim, dtype=self.hidden_dtype, device="meta")


def check_output_hook(training: torch.Tensor, evaluation: torch.Tensor, stage: int) -> Callable:
    """A forward hook that fails loudly when a stage's output is not what its `StageShapes` declared for a
    training forward (with gradients) or an evaluation one: the next stage would receive the bytes into a
    buffer of the declared shape and dtype."""

    def check(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        expected = training if torch.is_grad_enabled() else evaluation
        if output.shape != expected.shape or output.dtype != expected.dtype:
            raise RuntimeError(
                f"pipeline stage {stage} produced {tuple(output.shape)} {output.dtype}, but its StageShapes "
                f"declared {tuple(expected.shape)} {expected.dtype} (engine/parallel/pipeline.py)"
            )

    return check


def send_predictions(
    module: nn.Module, args: tuple, output: torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]
) -> torch.Tensor | None:
    """Forward hook of a last stage with multi-token prediction: a training forward's (main output, [module
    outputs]) as the one tensor a stage sends, concatenated along the batch (each is [batch, seq, ·]); an
    evaluation forward's main output (a tensor: no modules ran) as it is."""
    if isinstance(output, torch.Tensor):
        return None
    main, predictions = output
    return torch.cat([main, *predictions])


def stage_layer_names(n_layers: int, n_stages: int, mtp_depth: int = 0) -> list[list[str]]:
    """The block keys ("0", "1", …) each stage owns, in order (`stage_layers`)."""
    return [[str(i) for i in layers] for layers in stage_layers(n_layers, n_stages, mtp_depth)]


def stage_model(model: nn.Module, stage: int, n_stages: int) -> nn.Module:
    """A copy of `model` holding only what stage `stage` of `n_stages` runs (same parameter names): the blocks
    of its family's `ModelParts.blocks` it owns, the `first` modules on the first stage, the `last` on the last;
    with multi-token prediction its modules and a copy of the embedding on the last."""
    parts = spec_for(model.cfg).parts
    keep = set(stage_layer_names(model.cfg.n_layers, n_stages, model.cfg.mtp_depth)[stage])
    part = copy.deepcopy(model)
    blocks = getattr(part, parts.blocks)
    for name in list(blocks):
        if name not in keep:
            del blocks[name]
    last = stage == n_stages - 1
    dropped = [*(parts.first if stage != 0 else ()), *(parts.last if not last else ())]
    if has_predictions(model) and last:  # its modules look tokens up in the embedding
        dropped.remove(parts.tied[0])
    elif has_predictions(model):
        dropped.append(parts.mtp)
    for name in dropped:
        setattr(part, name, None)
    return part


def has_predictions(model: nn.Module) -> bool:
    """Whether `model` has multi-token-prediction modules (its family's `ModelParts.mtp`, set)."""
    name = spec_for(model.cfg).parts.mtp
    return name is not None and getattr(model, name, None) is not None


def split_stages(model: nn.Module, pp_rank: int, pp_size: int, n_stages_per_rank: int) -> list[tuple[int, nn.Module]]:
    """(stage index, stage model) for every stage pipeline rank `pp_rank` runs: stages pp_rank + k·pp_size."""
    n_stages = pp_size * n_stages_per_rank
    return [(stage, stage_model(model, stage, n_stages)) for stage in range(pp_rank, n_stages, pp_size)]


@dataclass
class TiedWeight:
    """This rank's copy of the embedding matrix the first and the last stage both hold (tied to the head, or
    looked up by multi-token prediction on the last stage): the `weight` of `module`, the first stage's
    embedding or the last stage's head or embedding copy, and the group of the two ranks holding those
    stages (the same data-parallel and tensor-parallel position)."""

    module: nn.Module
    group: dist.ProcessGroup
    is_copy: bool  # the last stage's: left out of the gradient norm, which counts the first's

    @property
    def param(self) -> nn.Parameter:
        """Looked up at each use: materializing the stage (`to_empty`) replaces the parameter object."""
        return self.module.weight

    def sync(self) -> None:
        """Sum the two copies' gradients (each rank's local shard, sharded alike on both ranks). Under tensor
        parallelism without FSDP a vocabulary-sharded embedding's gradient comes out of DTensor's lookup
        backward replicated ([vocab, dim] on every rank) while the head's is sharded like its weight: each is
        first laid out as its parameter is (Shard(0) of the same matrix on both ranks), so the two ranks
        reduce tensors of the same size, which are this rank's rows."""
        param, grad = self.param, self.param.grad
        if grad is None:
            grad = param.grad = torch.zeros_like(param)
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.group)


def tied_weight(parts: list[tuple[int, nn.Module]], n_stages: int, pp_mesh: DeviceMesh) -> TiedWeight | None:
    """The copy of the shared embedding matrix this rank holds among its (stage index, stage model) `parts`:
    the first stage's embedding, or the last stage's embedding copy (multi-token prediction), else its head;
    None on a rank with neither end. A collective over the whole world when pp > 2 (every rank creates every
    pair's group)."""
    group = first_last_group(pp_mesh)
    embedding, head = spec_for(parts[0][1].cfg).parts.tied
    for stage, part in parts:
        if stage == 0:
            return TiedWeight(getattr(part, embedding), group, is_copy=False)
        if stage == n_stages - 1:
            copy = getattr(part, embedding)
            return TiedWeight(copy if copy is not None else getattr(part, head), group, is_copy=True)
    return None


def first_last_group(pp_mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group of the first and last pipeline rank at this rank's position in the other mesh
    dimensions (pp is the outermost). With pp = 2 that is the pipeline group itself."""
    if pp_mesh.size() == 2:
        return pp_mesh.get_group()
    ranks = pp_mesh._get_root_mesh().mesh.reshape(pp_mesh.size(), -1)  # pp is the root mesh's first dimension
    mine = None
    for first, last in zip(ranks[0].tolist(), ranks[-1].tolist()):
        group = dist.new_group([first, last])  # every rank creates every group, in the same order
        if dist.get_rank() in (first, last):
            mine = group
    assert mine is not None
    return mine


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
    n_microbatches: int
    tied: TiedWeight | None = None  # with tied embeddings: this rank's copy of the shared matrix
    aux_losses: StageAuxLosses | None = None  # MoE: the routers' auxiliary losses of this rank's stages
    last_hidden: bool = False  # the last stage returns hidden states, not logits (StageShapes.last_hidden)
    predictions: bool = False  # the last stage runs multi-token prediction (StageShapes.predictions)

    def stage_kwargs(self, inputs: torch.Tensor, doc_ids: torch.Tensor | None, training: bool) -> dict[str, object]:
        """What every stage's forward receives besides its input: packed windows' document ids,
        `return_hidden` when the loss projects the last stage's hidden states itself, and in training with
        multi-token prediction the token ids `inputs` for its modules (the stages before the last ignore them;
        evaluation runs the main model alone)."""
        return {
            **documents(doc_ids),
            **({"return_hidden": True} if self.last_hidden else {}),
            **({"mtp": True, "mtp_tokens": inputs} if self.predictions and training else {}),
        }

    @property
    def norm_duplicates(self) -> set[nn.Parameter]:
        """Parameters whose gradient another pipeline rank holds too, which the global norm counts once."""
        return {self.tied.param} if self.tied is not None and self.tied.is_copy else set()

    def step(
        self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Forward and backward over all microbatches of one optimizer step; inputs and labels are
        [n_microbatches · batch, seq], and so are packed windows' `doc_ids`, which every rank passes (each
        of its stages attends within documents). → this rank's share of the step's loss (detached; `step_loss` sums
        the shares): the mean microbatch loss on the last stage's rank, plus with MoE the mean of this
        rank's stages' auxiliary losses; None for a dense model's other ranks. Gradients are left in the
        parts' .grad for the caller's clip and optimizer step. The schedule divides every .grad by
        n_microbatches at the end, so they must be zero (or None) before the call."""
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        target = labels if self.has_last_stage else None
        args = (inputs,) if self.has_first_stage else ()
        kwargs = self.stage_kwargs(inputs, doc_ids, training=True)
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        if self.tied is not None:
            self.tied.sync()
        share = None if losses is None else torch.stack([loss.detach() for loss in losses]).mean()
        if self.aux_losses is not None:
            aux = self.aux_losses.mean(self.n_microbatches, inputs.device)
            share = aux if share is None else share + aux
        return share

    @torch.no_grad()
    def evaluate(
        self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Forward only over all microbatches ([n_microbatches · batch, seq], the schedule's own split; packed
        windows' `doc_ids` likewise, on every rank); → the mean microbatch loss on the last stage's rank,
        else None."""
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        args = (inputs,) if self.has_first_stage else ()
        target = labels if self.has_last_stage else None
        kwargs = self.stage_kwargs(inputs, doc_ids, training=False)
        self.schedule.eval(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        for stage in self.stages:  # the schedule keeps every micro-batch's output until its next call
            stage.clear_runtime_states()
        return None if losses is None else torch.stack(losses).mean()

    def gather(self, mine: dict[str, float]) -> dict[str, float]:
        """Metrics some of the pipeline's ranks compute (`mine`, empty elsewhere), merged, on every rank of the
        pipeline (a collective: all its ranks call it)."""
        everyone: list[dict[str, float] | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        return {key: value for rows in everyone for key, value in (rows or {}).items()}

    def step_loss(self, share: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """The loss on every pipeline rank (a collective: all ranks of the pipeline call it): the sum of the
        ranks' shares from `step` or `evaluate` (None counts 0). A float64 scalar on every rank: the collective
        needs one dtype everywhere, and it keeps a float64 model's loss (the parity tests') unrounded."""
        value = share.detach().reshape(()) if share is not None else torch.zeros((), device=device)
        value = value.to(device=device, dtype=torch.float64, copy=True)
        dist.all_reduce(value, group=self.group)
        return value


def documents(doc_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The schedule's keyword arguments for every stage's forward: packed windows' document ids, or none
    (the stages' forward then runs exactly as without packing)."""
    return {} if doc_ids is None else {"doc_ids": doc_ids}


def build_pipeline(
    model: nn.Module,
    pp_mesh: DeviceMesh,
    schedule: str,
    n_microbatches: int,
    loss_fn: StageLoss,
    device: torch.device,
    shapes: StageShapes,
    parallelize_stage: Callable[[nn.Module], nn.Module] | None = None,
) -> Pipeline:
    """Cut `model` (the full single-device model, identical on every rank, possibly on the meta device) into
    this rank's stages, apply `parallelize_stage` to each (TP / AC / compile / FSDP — whatever the caller
    applies to a whole model otherwise), and build the schedule. `loss_fn` is the per-microbatch mean loss:
    the schedule divides gradients by `n_microbatches` itself. `shapes`: what the stages pass (see there)."""
    pp_rank, pp_size = pp_mesh.get_local_rank(), pp_mesh.size()
    per_rank = stages_per_rank(schedule)
    check_microbatches(schedule, pp_size, n_microbatches)
    group = pp_mesh.get_group()
    n_stages = pp_size * per_rank
    aux_losses = StageAuxLosses() if model.cfg.is_moe else None
    predictions = has_predictions(model)
    assert shapes.predictions == (model.cfg.mtp_depth if predictions else 0), "StageShapes.predictions"
    parts, stages, indexed = [], [], []
    for index, part in split_stages(model, pp_rank, pp_size, per_rank):
        module = parallelize_stage(part) if parallelize_stage is not None else part
        inputs, outputs = shapes.inputs(index), shapes.outputs(index, n_stages)
        if predictions and index == n_stages - 1:
            module.register_forward_hook(send_predictions)
        module.register_forward_hook(check_output_hook(outputs, shapes.outputs(index, n_stages, False), index))
        if aux_losses is not None:
            aux_losses.attach(module)
        parts.append(module)
        indexed.append((index, module))
        stages.append(
            PipelineStage(module, index, n_stages, device, input_args=inputs, output_args=outputs, group=group)
        )
    schedule_class = SCHEDULES[schedule]
    runner = schedule_class(stages if per_rank > 1 else stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    indices = [stage.stage_index for stage in stages]
    tied = tied_weight(indexed, n_stages, pp_mesh) if model.cfg.tie_embeddings or predictions else None
    return Pipeline(
        runner,
        parts,
        stages,
        has_first_stage=0 in indices,
        has_last_stage=n_stages - 1 in indices,
        group=group,
        loss_fn=loss_fn,
        n_microbatches=n_microbatches,
        tied=tied,
        aux_losses=aux_losses,
        last_hidden=shapes.last_hidden,
        predictions=predictions,
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
    union.cfg = parts[0].cfg  # the model's config (the optimizer's groups read tie_embeddings from it)
    model_parts = spec_for(union.cfg).parts
    blocks = nn.ModuleDict()
    setattr(union, model_parts.blocks, blocks)
    ends = model_parts.first + model_parts.last + ((model_parts.mtp,) if model_parts.mtp else ())
    for part in parts:
        blocks.update(getattr(part, model_parts.blocks))
        for name in ends:
            if getattr(part, name, None) is not None:
                setattr(union, name, getattr(part, name))
    if union.cfg.tie_embeddings:
        embedding, head = model_parts.tied
        if not hasattr(union, embedding) and hasattr(union, head):
            # The last stage's copy of a tied matrix, also under the embedding's name and registered before the
            # head: as in the full model, its parameter is then named as the embedding's (optimizer state, a
            # checkpoint's optimizer entries) while the state dict holds both names, so checkpoints match one
            # process's.
            module = getattr(union, head)
            delattr(union, head)
            setattr(union, embedding, module)
            setattr(union, head, module)
    return union
