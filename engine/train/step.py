"""One optimizer step, one evaluation, and what a logged step reports.

A step accumulates the gradients of its micro-batches (`train.grad_accum_steps`, or under a batch ramp the
step's own number: engine.data.batch_plan), or runs them through the pipeline schedule, then unscales, clips
and applies them, unless the step is bad (non-finite, or a loss spike), which every rank decides together. Everything model-specific (the MoE routers' balancing, their
metrics) is attached to the job when it is built (engine/train/job.py), not done here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from engine.data.device_batches import DeviceBatches
from engine.metrics.memory import memory_stats
from engine.metrics.mfu import mfu
from engine.parallel.grad_norm import clip_grad_norm
from engine.resilience.collectives import distributed
from engine.train.job import Job
from engine.train.losses import ModelLoss, StageCrossEntropy
from engine.train.optim import current_lr, eval_mode
from engine.train.source_losses import SourceLosses


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    problem: str | None  # why the update was skipped; None when it was applied
    source_losses: SourceLosses | None = None  # a mixture's per-source sums on this rank, reduced when logged
    stop_requested: bool = False  # a stop signal had reached some rank by this step's sync
    tokens: int = 0  # target tokens of the micro-batches this data-parallel rank trained on (their shapes)
    callback_failed: bool = False  # a loop callback had failed on some rank by this step's sync

    def as_metrics(self, step: int) -> dict[str, Any]:
        """What a config hook's on_step_end receives: every step has these, not only the logged ones."""
        return {"step": step, "loss": self.loss, "grad_norm": self.grad_norm, "lr": self.lr, "skipped": self.problem}


class StepEvents(Protocol):
    """The loop's events inside a step (engine/train/callbacks/base.py): the loop's callbacks hear them,
    and whether one of them has failed since the last step rides the step's sync."""

    def before_step(self, step: int) -> None: ...
    def before_optimizer_step(self, step: int) -> None: ...
    def callback_failed(self) -> bool: ...


def train_step(
    job: Job, step: int, batches: DeviceBatches, loss_fn, events: StepEvents, stop_requested: Callable[[], bool] = bool
) -> StepResult:
    """One optimizer step over grad_accum_steps micro-batches, or none when the step is bad (non-finite,
    or a loss spike): its batches are then consumed without an update, on every rank alike.

    The host waits for the device once, to read the loss and the gradient norm the bad-step guard needs
    (`step_totals`). Every rank takes the same decision without another collective: the guard sees the
    all-reduced loss and the global norm, and its history is built from those on every rank. Whether a stop
    signal reached any rank (`stop_requested()`, asked just before the sync) rides the same all-reduce, and so
    does whether a loop callback failed on any rank (`events.callback_failed()`)."""
    events.before_step(step)
    names = job.train_data.names
    tally = SourceLosses(names, job.device) if names else None
    if job.pipeline is not None:
        loss_sum, tokens = pipeline_forward_backward(job, batches, tally)
    else:
        accum = job.train_data.layout.micro_steps(step - 1)
        loss_sum, tokens = forward_backward(job, batches, loss_fn, tally, accum)
    events.before_optimizer_step(step)
    job.scaler.unscale_(job.optimizer)
    max_norm = job.cfg.train.grad_clip_norm or math.inf  # 0 = no clipping; the norm is still reported
    pipeline = job.pipeline
    grad_norm = clip_grad_norm(
        job.model.parameters(),
        max_norm,
        pipeline.group if pipeline else None,
        pipeline.norm_duplicates if pipeline else frozenset(),
    )
    lr = current_lr(job.optimizer)
    if step < job.cfg.train.max_steps:  # the next step's first micro-batch, moved while the device computes
        batches.prefetch()
    loss_value, norm_value, stopping, failed = step_totals(
        loss_sum, grad_norm, stop_requested(), events.callback_failed()
    )
    problem = job.guard.problem(loss_value, norm_value, scaler_handles_overflow=job.scaler.is_enabled())
    if problem is not None:
        if job.scaler.is_enabled():
            job.scaler.update()  # closes the unscale_ above without stepping
    else:
        job.checkpointer.wait_for_staging()  # a background save must hold its copy before weights change
        job.scaler.step(job.optimizer)
        job.scaler.update()
        job.refresh_float8_scales()
        job.guard.accept(loss_value)
    job.optimizer.zero_grad(set_to_none=True)
    job.scheduler.step()
    return StepResult(loss_value, norm_value, lr, problem, tally, stopping, tokens, failed)


def step_totals(
    loss: torch.Tensor, grad_norm: torch.Tensor, stop_requested: bool, callback_failed: bool = False
) -> tuple[float, float, bool, bool]:
    """(the step's loss averaged over all ranks, the global gradient norm, whether any rank was asked to stop,
    whether a callback failed on any rank), brought to the host in the step's one sync. The loss and the votes
    share one all-reduce (a sum), in the loss's dtype (float64 under pipeline parallelism, see
    Pipeline.step_loss), fp32 at least."""
    dtype = torch.promote_types(loss.dtype, torch.float32)
    votes = torch.tensor([float(stop_requested), float(callback_failed)], dtype=dtype, device=loss.device)
    values = torch.cat([loss.detach().reshape(1).to(dtype), votes])
    if distributed():
        torch.distributed.all_reduce(values)  # a sum: gloo has no average
        values[0] /= torch.distributed.get_world_size()
    # the norm is on the host under distributed.cpu_offload (the gradients are), on the loss's device otherwise
    norm = grad_norm.reshape(1).to(device=values.device, dtype=dtype)
    loss_value, stops, failures, norm_value = torch.cat([values, norm]).tolist()
    return loss_value, norm_value, stops > 0, failures > 0


def forward_backward(
    job: Job, batches: Iterator, loss_fn: ModelLoss, tally: SourceLosses | None, accum: int
) -> tuple[torch.Tensor, int]:
    """Gradients of the step's mean loss per token, accumulated over its `accum` micro-batches; → that loss (not
    synced) and the number of target tokens trained on: the labels' sizes, counted from their shapes on the
    host (a tensor's values would cost a sync), of the whole windows (before a cp split). Every micro-batch holds batch_size × seq_len tokens and its loss is their mean, so dividing by the
    step's own number of micro-batches (it varies under a batch ramp) makes the sum the mean over the step's
    tokens. A mixture's batches carry each row's source: its tokens' losses go into `tally`."""
    loss_sum = torch.zeros((), device=job.device)
    tokens = 0
    for _ in range(accum):
        inputs, labels, *sources = (t.to(job.device, non_blocking=True) for t in next(batches))
        tokens += labels.numel()
        doc_ids = job.documents(inputs)  # of the whole windows: under cp, before the split (engine.parallel.context)
        inputs, labels = job.local_batch(inputs, labels)
        record = tally.recorder(sources[0]) if tally is not None else None
        with job.loss_context():
            with job.autocast(), job.activation_offload():
                loss = loss_fn(job.model, inputs, labels, doc_ids=doc_ids, on_token_losses=record)
                loss = loss / accum
            job.scaler.scale(loss).backward()
        loss_sum += local_value(loss.detach())
    return loss_sum, tokens


def pipeline_forward_backward(job: Job, batches: Iterator, tally: SourceLosses | None) -> tuple[torch.Tensor, int]:
    """The same through the pipeline schedule, which takes the step's micro-batches at once and splits them
    again (in order, into as many); → the loss, on every pipeline rank, and the step's target tokens. The last stage's per-token losses,
    one [rows, seq] per microbatch in order, line up with the concatenated batches' sources: a mixture's
    per-source losses come from the last stage and reach the others through SourceLosses' all-reduce.
    Packed windows' document ids go to every rank's stages (each rank holds the whole batch)."""
    micro = [next(batches) for _ in range(job.cfg.train.grad_accum_steps)]
    inputs, labels, *sources = (torch.cat(parts).to(job.device, non_blocking=True) for parts in zip(*micro))
    stage_loss = job.pipeline.loss_fn
    assert isinstance(stage_loss, StageCrossEntropy), "the trainer builds its pipelines with this loss"
    with job.autocast(), stage_loss.recording() as token_losses:
        loss = job.pipeline.step(inputs, labels, job.documents(inputs))
    if tally is not None and token_losses:  # only the last stage computes losses, one call per microbatch
        tally.add(torch.cat(token_losses[-len(micro) :]), sources[0])
    return job.pipeline.step_loss(loss, job.device), labels.numel()


def local_value(value: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (under loss parallel it is a replicated DTensor)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of a per-rank loss over all ranks: the data-parallel mean (tensor-parallel ranks hold equal
    copies, which does not change a mean; context-parallel ranks the means of equally many positions of the
    same sequences, whose mean is the whole sequences')."""
    if not distributed():
        return value
    value = value.detach().clone()
    torch.distributed.all_reduce(value)  # a sum: gloo has no average
    return value / torch.distributed.get_world_size()


@torch.no_grad()
def evaluate(job: Job, loss_fn: ModelLoss) -> dict[str, float]:
    """Plain cross-entropy (no z-loss) on the held-out batches, at the optimizer's evaluation weights, and
    at the EMA of the weights as `eval_loss_ema` when the run keeps one."""
    with eval_mode(job.optimizer):
        loss = held_out_loss(job, loss_fn)
        # a mixture's sources with held-out sets of their own (data.datasets[].eval_path)
        per_source = {f"eval_loss/{n}": held_out_loss(job, loss_fn, d) for n, d in job.eval_data.per_source.items()}
    metrics = {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 80.0)), **per_source}
    if job.ema is not None:
        with job.ema.swapped_in():
            job.refresh_float8_scales()
            metrics["eval_loss_ema"] = held_out_loss(job, loss_fn)
        job.refresh_float8_scales()
    return metrics


def held_out_loss(job: Job, loss_fn: ModelLoss, data: Any = None) -> float:
    """The mean loss over the held-out batches (of `data`, default `job.eval_data`) at the model's current
    weights, over all ranks; with eval.steps = "all", over every held-out token (`weighted_mean`)."""
    data = job.eval_data if data is None else data
    job.model.eval()
    losses = pipeline_eval_losses(job, data) if job.pipeline is not None else eval_losses(job, loss_fn, data)
    job.model.train()
    if data.whole:
        return weighted_mean(torch.stack(losses), data.sampler.weights)
    return mean_over_ranks(torch.stack(losses).mean()).item()


def weighted_mean(losses: torch.Tensor, weights: list[int]) -> float:
    """Σ loss_b · rows_b / Σ rows_b over every rank's batches (each row is seq_len tokens, each loss their
    mean): the per-token mean over the whole held-out set. Summed in float64, so the order in which ranks add
    their parts does not show; tensor- and context-parallel copies scale both sums alike."""
    rows = torch.tensor(weights, dtype=torch.float64, device=losses.device)
    sums = torch.stack([(losses.detach().double() * rows).sum(), rows.sum()])
    if distributed():
        torch.distributed.all_reduce(sums)
    return (sums[0] / sums[1]).item()


def eval_losses(job: Job, loss_fn: ModelLoss, data: Any) -> list[torch.Tensor]:
    losses = []
    for batch in data.batches():
        inputs, labels = (t.to(job.device) for t in batch)
        doc_ids = job.documents(inputs)  # of the whole windows, before a cp split
        inputs, labels = job.local_batch(inputs, labels)
        with job.loss_context(), job.autocast():
            loss = loss_fn(job.model, inputs, labels, z_loss=False, doc_ids=doc_ids)
        losses.append(local_value(loss))
    return losses


def pipeline_eval_losses(job: Job, data: Any) -> list[torch.Tensor]:
    """The held-out batches through the pipeline schedule, forward only, `grad_accum_steps` of them per pass
    (its microbatches: validation makes eval.steps a multiple); → each pass's mean loss, on every rank."""
    batches, n = list(data.batches()), job.cfg.train.grad_accum_steps
    stage_loss = job.pipeline.loss_fn
    assert isinstance(stage_loss, StageCrossEntropy), "the trainer builds its pipelines with this loss"
    losses = []
    with stage_loss.plain():
        for first in range(0, len(batches), n):
            inputs, labels = (torch.cat(parts).to(job.device) for parts in zip(*batches[first : first + n]))
            with job.autocast():
                loss = job.pipeline.evaluate(inputs, labels, job.documents(inputs))
            losses.append(job.pipeline.step_loss(loss, job.device))
    return losses


def step_metrics(
    job: Job, step: int, result: StepResult, tokens_per_sec: float, tokens_seen: int, started: float
) -> dict[str, Any]:
    world = job.place.world_size
    peak = None if job.peak_flops is None else job.peak_flops * world  # tokens/s is the whole job's
    return {
        "step": step,
        "loss": result.loss,
        "lr": result.lr,
        "grad_norm": result.grad_norm,
        "tokens_per_sec": tokens_per_sec,
        "mfu": mfu(job.summary["flops_per_token"], tokens_per_sec, peak),
        "flops_per_sec": job.summary["flops_per_token"] * tokens_per_sec,
        "tokens_seen": tokens_seen,
        "elapsed_sec": time.perf_counter() - started,
        **ramp_metrics(job, step),
        **job.guard.metrics(),
        **job.train_data.metrics(step),
        **(result.source_losses.metrics() if result.source_losses is not None else {}),
        **memory_per_rank(job.device),
        **{k: v for report in job.model_metrics for k, v in report().items()},
    }


def ramp_metrics(job: Job, step: int) -> dict[str, int]:
    """Under a batch ramp, the sequences logged step `step` trained on (over all data-parallel ranks): a record's
    batch size is otherwise fixed by the config and not repeated in every line."""
    plan = job.batch_plan
    return {"batch_sequences": plan.sequences(step - 1)} if plan is not None and plan.ramp is not None else {}


def memory_per_rank(device: torch.device) -> dict[str, float]:
    """This rank's memory figures; in a multi-process run, `mem_peak_gib` is the largest rank's peak and
    `mem_peak_gib/rank{r}` each rank's (every rank calls this at the same steps)."""
    stats = memory_stats(device)
    if not distributed():
        return stats
    world = torch.distributed.get_world_size()
    peaks = torch.zeros(world, dtype=torch.float64, device=device)
    peaks[torch.distributed.get_rank()] = stats["mem_peak_gib"]
    torch.distributed.all_reduce(peaks)  # a gather by sum: each rank fills its own slot
    per_rank = peaks.tolist()
    return {**stats, "mem_peak_gib": max(per_rank), **{f"mem_peak_gib/rank{r}": v for r, v in enumerate(per_rank)}}
