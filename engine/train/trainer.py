"""The training loop: one process, or one of many (torchrun, srun, `forge train --nproc-per-node`).

`train(cfg, run_dir)` checks everything that can be wrong with the job (config, data, run directory)
before it writes anything, then trains, logs, evaluates and checkpoints. In a multi-process run every
rank runs this same loop on its part of the mesh (`engine.parallel`); rank 0 alone writes the run
directory, metrics and the checkpoint's train state, and decisions (skip a step, stop, save) are agreed
across ranks. A run directory that already
holds a run is resumed from its newest complete checkpoint, and the resumed run computes exactly what
the uninterrupted one would have: same weights, optimizer state, LR schedule, RNG and data position.

The job is built in engine/train/job.py, one step is engine/train/step.py, the run directory
engine/train/run_dir.py; this module is the loop itself, with preemption and rollback.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from engine.config.job import JobConfig
from engine.data.device_batches import DeviceBatches
from engine.eval.in_training import TrainingTasks, open_tasks
from engine.metrics.trackers import MetricsLogger
from engine.parallel.launch import leave_process_group
from engine.parallel.place import process_place
from engine.resilience.anomaly import TrainingDiverged
from engine.resilience.collectives import any_rank, distributed, on_rank0
from engine.resilience.health import check_collectives
from engine.resilience.signals import Preempted, StopRequest
from engine.train.hooks import ConfigHooks, HookFailed, TrainHooks
from engine.train.job import Job, build_job, train_state
from engine.train.lora_merge import merge_adapters
from engine.train.losses import ModelLoss, build_loss
from engine.train.optim import eval_mode
from engine.train.profiling import ProfilerWindow
from engine.train.reporting import Reporter, SilentReporter
from engine.train.run_dir import RunOutputs, logging_to, open_run_dir
from engine.train.step import StepResult, evaluate, step_metrics, train_step

log = logging.getLogger("forge.train")


def train(
    cfg: JobConfig,
    run_dir: Path,
    reporter: Reporter | None = None,
    hooks: TrainHooks | None = None,
    allow_run_dir_code: bool = False,
) -> dict[str, Any]:
    """Train `cfg` into `run_dir`, or continue the run there; return the final summary. A `[[train.hooks]]`
    module found inside a run directory is refused unless `allow_run_dir_code` (engine/train/hooks.py).

    Raises `Preempted` after an emergency checkpoint when SIGTERM/SIGUSR1 arrives, `TrainingDiverged`
    when rollbacks cannot recover the loss, `CollectiveTimeout` when a rank stops answering,
    `CheckpointWriteError` when a checkpoint cannot be written, `HookFailed` after a checkpoint when a
    `[[train.hooks]]` hook raises (engine/train/hooks.py)."""
    # a bad hook fails before anything
    config_hooks = ConfigHooks(cfg.train.hooks, process_place().rank == 0, run_dir, allow_run_dir_code)
    with StopRequest(cfg.train.shutdown_timeout_sec).installed() as stop, process_group_released():
        job = build_job(cfg, run_dir)  # a signal during setup counts too
        if job.start_step >= job.cfg.train.max_steps:
            return {
                "steps": job.start_step,
                "tokens_seen": job.tokens_seen,
                "already_complete": True,
                "run_dir": str(run_dir),
            }
        tasks = open_tasks(job.cfg, job.train_data.tokenizer_file)  # eval.tasks: found and loaded before writing
        outputs = open_run_dir_on_main(job)
        with logging_to(job.run_dir / "train.log") if job.is_main else contextlib.nullcontext():
            ending: dict[str, Any] = {"reason": "failed"}
            try:
                summary = run_loop(
                    job,
                    outputs.trackers,
                    (reporter or SilentReporter()) if job.is_main else SilentReporter(),
                    hooks or TrainHooks(),
                    config_hooks,
                    stop,
                    tasks,
                )
                ending = {"reason": "complete", "step": summary["steps"]}
                return summary
            except BaseException as err:
                ending = attempt_end(err)
                finish_pending_save(job)
                raise
            finally:
                outputs.close(ending)


def attempt_end(err: BaseException) -> dict[str, Any]:
    """How an attempt that raised ended, for the run's attempt log (`forge runs` shows it)."""
    if isinstance(err, Preempted):
        return {"reason": "preempted", "step": err.step, "signal": err.signal_name}
    message = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    return {"reason": "failed", "error": message[:500]}


@contextlib.contextmanager
def process_group_released() -> Iterator[None]:
    """Leave the process group at the end of the run. After a normal end every rank first waits for the
    others (rank 0 may still be closing the metric sinks): a rank that tears its connections down while
    another still has them open can abort in gloo's teardown."""
    try:
        yield
    except BaseException:
        leave_process_group()
        raise
    if distributed():
        torch.distributed.barrier()
    leave_process_group()


def open_run_dir_on_main(job: Job) -> RunOutputs:
    """Rank 0 writes the run directory; the others log nothing. If rank 0 cannot (W&B not logged in), every
    rank stops, instead of the others waiting in the first collective until the timeout."""
    record = job.record or job.cfg
    derived = job.cfg.train.max_steps if record.train.max_steps is None else None  # from max_epochs or max_tokens
    attempt = partial(
        open_run_dir,
        record,
        job.run_dir,
        job.train_data,
        job.start_step,
        job.wandb_run_id,
        derived,
        checkpoint_dir=job.checkpoint_lock_dir,
    )
    return on_rank0(attempt, RunOutputs(MetricsLogger([])), job.device, "open the run directory")


def finish_pending_save(job: Job) -> None:
    """A run stopping on an error still completes the background save in flight: it holds good weights.
    Not in a multi-process run: finishing ends in a barrier, and the other ranks, which did not fail, are
    not there (the unfinished folder has no COMPLETE marker and a resume skips it)."""
    if distributed():
        log.warning("the background checkpoint in flight is left unfinished; the run resumes from the one before")
        return
    try:
        job.checkpointer.wait()
    except Exception as err:  # the original error is the one to report
        log.error("the checkpoint being written could not be finished: %s", err)


class ThroughputWindow:
    """Tokens/s over the steps since the last log, not counting time spent in eval or checkpoints."""

    def __init__(self) -> None:
        self.start, self.tokens, self.paused = time.perf_counter(), 0, 0.0

    def rate(self) -> float:
        return self.tokens / (time.perf_counter() - self.start - self.paused)

    def reset(self) -> None:
        self.__init__()

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        begun = time.perf_counter()
        try:
            yield
        finally:
            self.paused += time.perf_counter() - begun


@dataclass
class Progress:
    """What changes from step to step of the loop (everything else is in the Job)."""

    tokens_seen: int
    started: float  # time.perf_counter() at the run's start: elapsed time counts earlier attempts too
    window: ThroughputWindow = field(default_factory=ThroughputWindow)
    last: dict[str, Any] = field(default_factory=dict)  # the latest logged metrics, with the latest eval's

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def run_loop(
    job: Job,
    trackers: MetricsLogger,
    reporter: Reporter,
    hooks: TrainHooks,
    config_hooks: ConfigHooks,
    stop: StopRequest,
    tasks: TrainingTasks | None = None,
) -> dict[str, Any]:
    cfg, t = job.cfg, job.cfg.train
    loss_fn = build_loss(t)
    profiler = ProfilerWindow(cfg.profiling, job.run_dir, job.device, job.place.rank)
    info = {
        "run_dir": str(job.run_dir),
        "device": str(job.device),
        "dtype": str(job.dtype).removeprefix("torch."),
        "max_steps": t.max_steps,
        "start_step": job.start_step,
        "peak_flops": job.peak_flops,
        "warnings": list(job.warnings),
        **job.summary,
    }
    reporter.on_start(info)
    log.info("start %s", info)
    for issue in job.warnings:
        log.warning("%s: %s (%s)", issue.path, issue.problem, issue.hint)
    monitor = torch.distributed.new_group(backend="gloo") if t.nccl_health_check_interval and distributed() else None

    batches = DeviceBatches(job.train_data.batches(start_step=job.start_step), job.device)
    job.model.train()
    progress = Progress(job.tokens_seen, time.perf_counter() - job.elapsed_sec)
    for step in range(job.start_step + 1, t.max_steps + 1):
        with profiler.step(step):
            result = train_step(job, step, batches, loss_fn, hooks, lambda: stop.requested)
        merge_due_adapters(job, step)
        # counted from what the step trained on, the same on every data-parallel rank (their batches have one
        # shape); tensor- and context-parallel ranks share a rank's windows, pipeline stages the whole batch
        tokens = result.tokens * job.summary["data_parallel"]
        progress.tokens_seen += tokens
        progress.window.tokens += tokens
        checkpoint_done(reporter, job.checkpointer.poll())
        if result.problem is not None:
            skipped(job, step, result.problem, progress)
        if step == 1 or step % cfg.metrics.log_interval == 0 or step == t.max_steps:
            log_step(job, step, result, progress, trackers, reporter)
        if job.eval_data is not None and (step % cfg.eval.interval == 0 or step == t.max_steps):
            metrics = log_eval(job, step, loss_fn, progress, trackers, reporter)
            with stop_on_hook_failure(job, step, progress, trackers, reporter):
                config_hooks.eval(step, metrics, job)
        if tasks is not None and tasks.due(step, t.max_steps):
            log_tasks(job, tasks, step, progress, trackers)
        with stop_on_hook_failure(job, step, progress, trackers, reporter):
            config_hooks.step_end(step, result.as_metrics(step), job)
        if t.nccl_health_check_interval and monitor is not None and step % t.nccl_health_check_interval == 0:
            check_collectives(cfg.distributed.nccl_timeout_sec, job.device, monitor)
        # agreed in the step's one sync (a signal after it counts at the next step); the last step just finishes
        preempted = result.stop_requested and step < t.max_steps
        wanted = job.checkpointer.due(step, t.max_steps) or (preempted and not job.checkpointer.has(step))
        if wanted and checkpoint(job, step, preempted, progress, trackers, reporter):
            with stop_on_hook_failure(job, step, progress, trackers, reporter):
                config_hooks.checkpoint(step, job.checkpointer.root / f"step_{step}", job)
        if preempted:
            checkpoint_done(reporter, job.checkpointer.wait())
            path = job.checkpointer.root / f"step_{step}"
            raise Preempted(stop.signal_name or "a signal on another rank", step, str(path) if path.exists() else None)
    checkpoint_done(reporter, job.checkpointer.wait())
    profiler.close(t.max_steps)
    summary = {
        "steps": t.max_steps,
        "start_step": job.start_step,
        "tokens_seen": progress.tokens_seen,
        "train_time_sec": progress.elapsed(),
        "final_loss": progress.last.get("loss"),
        "final_eval_loss": progress.last.get("eval_loss"),
        **job.guard.metrics(),
        "run_dir": str(job.run_dir),
    }
    with stop_on_hook_failure(job, t.max_steps, progress, trackers, reporter):
        config_hooks.run_end(t.max_steps, summary, job)
    reporter.on_end(summary)
    log.info("done %s", summary)
    return summary


def merge_due_adapters(job: Job, step: int) -> None:
    """Every lora.merge_interval steps, after the update: fold the adapters into the base and restart them
    (engine.train.lora_merge.merge_adapters; the model computes the same function before and after). The
    generator of the new A is seeded by the step, so a resumed run merges exactly as the first attempt."""
    interval = job.cfg.lora.merge_interval
    if not job.cfg.lora.enabled or interval is None or step % interval:
        return
    job.checkpointer.wait_for_staging()  # a background save must hold its copy before the weights change
    merged = merge_adapters(job.model, job.cfg.lora, job.cfg.train.seed + step, job.optimizer)
    log.info("step %d: merged %d LoRA adapters into the base weights", step, merged)


@contextlib.contextmanager
def stop_on_hook_failure(
    job: Job, step: int, progress: Progress, trackers: MetricsLogger, reporter: Reporter
) -> Iterator[None]:
    """A config hook failed (on some rank; all raise together): save step `step` unless it is saved, finish
    the save, and stop with the hook's error and where the checkpoint is."""
    try:
        yield
    except HookFailed as err:
        if not job.checkpointer.has(step):
            checkpoint(job, step, True, progress, trackers, reporter)
        checkpoint_done(reporter, job.checkpointer.wait())
        path = job.checkpointer.root / f"step_{step}"
        raise HookFailed(f"{err}; the run stopped with its checkpoint {path}") from err


def skipped(job: Job, step: int, problem: str, progress: Progress) -> None:
    """A bad step changed nothing; after `train.max_bad_steps` of them in a row, roll back."""
    log.warning("step %d skipped: %s", step, problem)
    if job.guard.reject():
        with progress.window.pause():
            roll_back(job, step, f"{job.cfg.train.max_bad_steps} bad steps in a row")


def log_step(
    job: Job, step: int, result: StepResult, progress: Progress, trackers: MetricsLogger, reporter: Reporter
) -> None:
    progress.last = step_metrics(job, step, result, progress.window.rate(), progress.tokens_seen, progress.started)
    trackers.log(step, progress.last)
    reporter.on_log(step, progress.last)
    log.info(
        "step %d loss %.4f lr %.3e grad_norm %.3f tokens/s %.0f",
        step,
        progress.last["loss"],
        result.lr,
        progress.last["grad_norm"],
        progress.last["tokens_per_sec"],
    )
    progress.window.reset()


def log_eval(
    job: Job, step: int, loss_fn: ModelLoss, progress: Progress, trackers: MetricsLogger, reporter: Reporter
) -> dict[str, Any]:
    with progress.window.pause():
        metrics = evaluate(job, loss_fn)
    trackers.log(step, metrics)
    reporter.on_eval(step, metrics)
    log.info("eval step %d loss %.4f", step, metrics["eval_loss"])
    progress.last.update(metrics)
    return metrics


def log_tasks(job: Job, tasks: TrainingTasks, step: int, progress: Progress, trackers: MetricsLogger) -> None:
    """eval.tasks at the weights the optimizer evaluates (engine.eval.in_training), logged as eval/TASK/METRIC."""
    with progress.window.pause(), eval_mode(job.optimizer):
        metrics = tasks.evaluate(job.model, job.device)
    trackers.log(step, metrics)
    log.info("tasks step %d %s", step, " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
    progress.last.update(metrics)


def checkpoint(
    job: Job, step: int, preempted: bool, progress: Progress, trackers: MetricsLogger, reporter: Reporter
) -> bool:
    """Save step `step` (due, or the run is preempted), never with non-finite weights; False when postponed."""
    if any_rank(not weights_finite(job.model), job.device):  # never checkpoint non-finite weights
        log.error("step %d: non-finite weights; rolling back instead of saving them", step)
        with progress.window.pause():
            roll_back(job, step, "non-finite weights")
    if job.guard.consecutive_bad and step < job.cfg.train.max_steps and not preempted:
        # Skipped steps leave the weights as they were, so this checkpoint would repeat the last
        # good one and make the next rollback a no-op: wait for a good step.
        log.warning("step %d: checkpoint postponed during a run of bad steps", step)
        return False
    with progress.window.pause():
        state = train_state(job, step, progress.tokens_seen, progress.elapsed(), trackers.wandb_run_id)
        path = job.checkpointer.save(step, job.model, job.optimizer, state)  # None: finishes in the background
    if path is not None:
        checkpoint_done(reporter, (step, path))
    return True


def checkpoint_done(reporter: Reporter, done: tuple[int, Path] | None) -> None:
    if done is not None:
        reporter.on_checkpoint(*done)
        log.info("checkpoint %s", done[1])


def weights_finite(model: torch.nn.Module) -> bool:
    """This rank's shards only: callers agree over ranks. Only the parameters that train can have become
    non-finite (a frozen LoRA base, possibly NF4, is as loaded)."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters() if p.requires_grad]
    return bool(torch.stack([p.detach().isfinite().all() for p in local]).all())


def roll_back(job: Job, step: int, reason: str) -> None:
    """Reload the last checkpoint's weights and optimizer state and go on with the next batches. The LR
    schedule keeps its place (the optimizer's restored LR is put back)."""
    lrs = [group["lr"] for group in job.optimizer.param_groups]
    if job.guard.rollbacks >= job.cfg.train.max_rollbacks:
        job.guard.rolled_back(reason, None)  # raises TrainingDiverged
    restored = job.checkpointer.rollback(job.model, job.optimizer)
    if restored is None:
        raise TrainingDiverged(
            f"{reason} at step {step}, before the first checkpoint, so there is nothing to "
            "roll back to; lower optimizer.lr or check the data"
        )
    job.guard.rolled_back(reason, restored[1])
    if job.ema is not None:
        job.ema.after_load(restored[1])
    job.refresh_float8_scales()
    for group, lr in zip(job.optimizer.param_groups, lrs):
        group["lr"] = lr
    log.warning(
        "step %d: %s; rolled back to %s (rollback %d of at most %d)",
        step,
        reason,
        restored[0],
        job.guard.rollbacks,
        job.cfg.train.max_rollbacks,
    )
