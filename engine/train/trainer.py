"""The training loop: one process, or one of many (torchrun, srun, `forge train --nproc-per-node`).

`train(cfg, run_dir)` checks everything that can be wrong with the job (config, data, run directory)
before it writes anything, then trains, logs, evaluates and checkpoints. In a multi-process run every
rank runs this same loop on its part of the mesh (`engine.parallel`); rank 0 alone writes the run
directory, metrics and the checkpoint's train state, and decisions (skip a step, stop, save) are agreed
across ranks. A run directory that already
holds a run is resumed from its newest complete checkpoint, and the resumed run computes exactly what
the uninterrupted one would have: same weights, optimizer state, LR schedule, RNG and data position.

The job is built in engine/train/job.py, one step is engine/train/step.py, the run directory
engine/train/run_dir.py; this module is the loop itself: the step, the bad-step guard and the events
its callbacks hear (engine/train/callbacks/base.py), which do everything else.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from engine.config.job import JobConfig
from engine.data.device_batches import DeviceBatches
from engine.eval.in_training import open_tasks
from engine.metrics.callback import SinkCallback, saved_wandb_run_id
from engine.metrics.trackers import MetricsLogger
from engine.parallel.launch import leave_process_group
from engine.parallel.place import process_place
from engine.plan.job import ResolvedJob
from engine.resilience.collectives import distributed, on_rank0
from engine.resilience.signals import Preempted, StopRequest
from engine.train.callbacks.base import Callback, CallbackFailed
from engine.train.callbacks.checkpointing import Checkpointing, finish, save, step_path
from engine.train.callbacks.dispatch import Callbacks
from engine.train.callbacks.ema import EmaUpdate
from engine.train.callbacks.evaluation import HeldOutEval
from engine.train.callbacks.health import CollectiveHealth
from engine.train.callbacks.lora_merge import LoraMerge
from engine.train.callbacks.tasks import InLoopTasks
from engine.train.hooks import ConfigHooks
from engine.train.job import Job, build_job
from engine.train.losses import ModelLoss, build_loss
from engine.train.profiling import ProfilerWindow
from engine.train.rollback import roll_back
from engine.train.run_dir import RunOutputs, logging_to, open_run_dir
from engine.train.step import StepResult, step_metrics, train_step

log = logging.getLogger("forge.train")


def train(
    cfg: JobConfig,
    run_dir: Path,
    callbacks: Sequence[Callback] = (),
    allow_run_dir_code: bool = False,
    resolved: ResolvedJob | None = None,
) -> dict[str, Any]:
    """Train `cfg` into `run_dir`, or continue the run there; return the final summary. `callbacks`: the
    caller's own (a console, a probe; the same list on every rank), beside the engine's. A `[[train.hooks]]`
    module found inside a run directory is refused unless `allow_run_dir_code` (engine/train/hooks.py).
    `resolved`: `cfg` resolved for this process's world size (engine/plan/job.py), when the caller has it.

    Raises `Preempted` after an emergency checkpoint when SIGTERM/SIGUSR1 arrives, `TrainingDiverged`
    when rollbacks cannot recover the loss, `CollectiveTimeout` when a rank stops answering,
    `CheckpointWriteError` when a checkpoint cannot be written, `CallbackFailed` after a checkpoint when a
    callback or a `[[train.hooks]]` hook (`HookFailed`) raises."""
    # a bad hook fails before anything
    config_hooks = ConfigHooks(cfg.train.hooks, process_place().rank == 0, run_dir, allow_run_dir_code)
    with StopRequest(cfg.train.shutdown_timeout_sec).installed() as stop, process_group_released():
        job = build_job(cfg, run_dir, resolved)  # a signal during setup counts too
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
                engine_callbacks = [*loop_callbacks(job, tasks), config_hooks]
                sinks = [SinkCallback(name, sink) for name, sink in outputs.trackers.named.items()]
                loop = TrainLoop.start(job, [*engine_callbacks, *sinks, *callbacks], build_loss(job.cfg.train))
                summary = run_loop(loop, stop)
                ending = {"reason": "complete", "step": summary["steps"]}
                return summary
            except BaseException as err:
                ending = attempt_end(err)
                finish_pending_save(job)
                raise
            finally:
                outputs.close(ending)


def loop_callbacks(job: Job, tasks: Any) -> list[Callback]:
    """The engine's callbacks this run's config asks for."""
    cfg = job.cfg
    found: list[Callback] = [Checkpointing()]
    if cfg.profiling.enable:
        found.append(ProfilerWindow(cfg.profiling, job.run_dir, job.device, job.place.rank))
    if job.ema is not None:
        found.append(EmaUpdate(job.ema))
    if cfg.lora.enabled and cfg.lora.merge_interval is not None:
        found.append(LoraMerge(cfg.lora.merge_interval))
    if job.eval_data is not None:
        found.append(HeldOutEval())
    if tasks is not None:
        found.append(InLoopTasks(tasks))
    if cfg.train.nccl_health_check_interval and distributed():
        found.append(CollectiveHealth(cfg.train.nccl_health_check_interval, cfg.distributed.nccl_timeout_sec))
    return found


def run_loop(loop: TrainLoop, stop: StopRequest) -> dict[str, Any]:
    """The steps and the events around them (engine/train/callbacks/base.py has their order)."""
    job, events, max_steps = loop.job, loop.callbacks, loop.job.cfg.train.max_steps
    batches = DeviceBatches(job.train_data.batches(start_step=job.start_step), job.device)
    job.model.train()
    for step in range(job.start_step + 1, max_steps + 1):
        result = train_step(job, step, batches, loop.loss_fn, loop, lambda: stop.requested)
        loop.count(result)
        with loop.saved_on_failure(step):
            events.emit("after_optimizer_step", step, step, result, loop)
            if result.problem is not None:
                loop.skipped(step, result.problem)
            if loop.log_due(step):
                loop.log_step(step, result)
            if step % job.cfg.eval.interval == 0 or step == max_steps:
                events.emit("on_eval_due", step, step, loop)
            events.emit("after_step", step, step, result, loop)
            events.raise_failure(step, result.callback_failed)  # agreed in the step's sync
            # agreed in the step's one sync (a signal after it counts at the next step); the last step just finishes
            loop.stopping = result.stop_requested and step < max_steps
            if job.checkpointer.due(step, max_steps):
                events.emit("on_checkpoint_due", step, step, loop)
            if loop.stopping:
                events.emit("on_preempted", step, step, loop)
                events.settle(step)
        if loop.stopping:
            path = step_path(loop, step)
            raise Preempted(stop.signal_name or "a signal on another rank", step, str(path) if path.exists() else None)
    summary = loop.summary()
    with loop.saved_on_failure(max_steps):
        events.emit("on_end", max_steps, summary, loop)
        events.settle(max_steps)
    log.info("done %s", summary)
    return summary


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
        saved_wandb_run_id(job.callback_states),
        derived,
        checkpoint_dir=job.checkpoint_lock_dir,
    )
    return on_rank0(attempt, RunOutputs(MetricsLogger({})), job.device, "open the run directory")


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


@dataclass
class TrainLoop:
    """What the loop's callbacks see of it: the job, its progress, what it started with, and `log`; and the
    step events train_step emits (engine.train.step.StepEvents)."""

    job: Job
    callbacks: Callbacks
    loss_fn: ModelLoss
    progress: Progress
    info: dict[str, Any]  # what the run starts with (device, steps, parameters, warnings), for consoles
    stopping: bool = False  # a stop signal arrived by this step: the run saves and stops after it

    @classmethod
    def start(cls, job: Job, callbacks: Sequence[Callback], loss_fn: ModelLoss) -> TrainLoop:
        """The loop at its first step: a resumed run's callbacks hold their saved state."""
        dispatch = Callbacks(callbacks, job.is_main, job.device)
        dispatch.load_states(job.callback_states)
        info = {
            "run_dir": str(job.run_dir),
            "device": str(job.device),
            "dtype": str(job.dtype).removeprefix("torch."),
            "max_steps": job.cfg.train.max_steps,
            "start_step": job.start_step,
            "peak_flops": job.peak_flops,
            "warnings": list(job.warnings),
            **job.summary,
        }
        progress = Progress(job.tokens_seen, time.perf_counter() - job.elapsed_sec)
        loop = cls(job, dispatch, loss_fn, progress, info)
        dispatch.emit("on_start", job.start_step, loop)
        dispatch.settle(job.start_step)  # nothing new to save yet: a failure stops before the first step
        log.info("start %s", info)
        for issue in job.warnings:
            log.warning("%s: %s (%s)", issue.path, issue.problem, issue.hint)
        return loop

    def before_step(self, step: int) -> None:
        self.callbacks.emit("before_step", step, step, self)

    def before_optimizer_step(self, step: int) -> None:
        self.callbacks.emit("before_optimizer_step", step, step, self)

    def callback_failed(self) -> bool:
        return self.callbacks.failure is not None

    def log(self, step: int, metrics: dict[str, Any], kind: str) -> None:
        """Send `metrics` of step `step` to every sink and console (`on_metrics`); call it on every rank."""
        self.progress.last.update(metrics)
        self.callbacks.emit("on_metrics", step, step, metrics, kind, self)

    def count(self, result: StepResult) -> None:
        """The tokens of a step, counted from what it trained on, the same on every data-parallel rank (their
        batches have one shape); tensor- and context-parallel ranks share a rank's windows, pipeline stages
        the whole batch."""
        tokens = result.tokens * self.job.summary["data_parallel"]
        self.progress.tokens_seen += tokens
        self.progress.window.tokens += tokens

    def log_due(self, step: int) -> bool:
        return step == 1 or step % self.job.cfg.metrics.log_interval == 0 or step == self.job.cfg.train.max_steps

    def log_step(self, step: int, result: StepResult) -> None:
        progress = self.progress
        metrics = step_metrics(self.job, step, result, progress.window.rate(), progress.tokens_seen, progress.started)
        progress.last = dict(metrics)
        self.callbacks.emit("on_metrics", step, step, metrics, "train", self)
        log.info(
            "step %d loss %.4f lr %.3e grad_norm %.3f tokens/s %.0f",
            step,
            metrics["loss"],
            result.lr,
            metrics["grad_norm"],
            metrics["tokens_per_sec"],
        )
        progress.window.reset()

    def skipped(self, step: int, problem: str) -> None:
        """A bad step changed nothing; after `train.max_bad_steps` of them in a row, roll back."""
        log.warning("step %d skipped: %s", step, problem)
        if self.job.guard.reject():
            with self.progress.window.pause():
                roll_back(self.job, step, f"{self.job.cfg.train.max_bad_steps} bad steps in a row")

    def summary(self) -> dict[str, Any]:
        job, progress = self.job, self.progress
        return {
            "steps": job.cfg.train.max_steps,
            "start_step": job.start_step,
            "tokens_seen": progress.tokens_seen,
            "train_time_sec": progress.elapsed(),
            "final_loss": progress.last.get("loss"),
            "final_eval_loss": progress.last.get("eval_loss"),
            **job.guard.metrics(),
            "run_dir": str(job.run_dir),
        }

    @contextlib.contextmanager
    def saved_on_failure(self, step: int) -> Iterator[None]:
        """A callback failed (on some rank; all raise together): save step `step` unless it is saved, finish
        the save, and stop with the callback's error and where the checkpoint is."""
        try:
            yield
        except CallbackFailed as err:
            if not self.job.checkpointer.has(step):
                save(self, step, True)
            finish(self)
            raise type(err)(f"{err}; the run stopped with its checkpoint {step_path(self, step)}") from err
