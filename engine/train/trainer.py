"""The training loop: one process, CPU or one GPU.

`train(cfg, run_dir)` checks everything that can be wrong with the job (config, data, run directory)
before it writes anything, then trains, logs, evaluates and checkpoints. A run directory that already
holds a run is resumed from its newest complete checkpoint, and the resumed run computes exactly what
the uninterrupted one would have: same weights, optimizer state, LR schedule, RNG and data position.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from engine.checkpoint.dcp import latest_checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint
from engine.checkpoint.rng import restore_rng, rng_state
from engine.config.changes import resume_issues
from engine.config.job import JobConfig
from engine.config.loader import dump_toml, load_job_config
from engine.config.registry import MODELS
from engine.durable import write_durably
from engine.errors import ConfigError, UserError
from engine.metrics.memory import memory_stats
from engine.metrics.mfu import mfu, peak_flops
from engine.metrics.trackers import MetricsLogger, build_trackers
from engine.model.attention import CPU_SDPA_BACKENDS
from engine.model.transformer import Transformer
from engine.parallel.apply import parallelize
from engine.train import precision
from engine.train.losses import build_loss
from engine.train.optim import build_optimizer
from engine.train.profiling import ProfilerWindow
from engine.train.reporting import Reporter, SilentReporter
from engine.train.schedules import build_scheduler
from engine.train.summary import job_summary

log = logging.getLogger("forge.train")


def pick_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def checkpoint_root(cfg: JobConfig, run_dir: Path) -> Path:
    return run_dir / cfg.checkpoint.dir


RUN_CONFIG = "config.toml"


def run_config(run_dir: Path, overrides: list[str] = ()) -> JobConfig:
    """The saved config of an existing run, with overrides (which `train` then checks are safe)."""
    if not (run_dir / RUN_CONFIG).is_file():
        raise UserError(f"{run_dir} is not a Forge run directory (it has no {RUN_CONFIG})",
                        "pass the folder `forge train` wrote, e.g. runs/debug")
    return load_job_config(run_dir / RUN_CONFIG, overrides)


def with_pinned_schedule(cfg: JobConfig) -> JobConfig:
    """The config with `scheduler.decay_steps` resolved, as the run directory records it: a run resumed
    with a larger train.max_steps then continues the schedule it trained with (at the floor once decayed)
    instead of stretching the decay and jumping the LR."""
    if cfg.scheduler.decay_steps is not None:
        return cfg
    decay = max(cfg.train.max_steps - cfg.scheduler.warmup_steps - 1, 1)
    return cfg.model_copy(update={"scheduler": cfg.scheduler.model_copy(update={"decay_steps": decay})})


def check_run_dir(cfg: JobConfig, run_dir: Path) -> tuple[int, Path] | None:
    """A new run directory, or an existing run that `cfg` may continue. Returns the checkpoint to resume
    from (None: start at step 0, which an existing run killed before its first checkpoint also does)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} is a file", "pass --run-dir with a folder path")
    if (run_dir / RUN_CONFIG).is_file():
        issues = resume_issues(load_job_config(run_dir / RUN_CONFIG), cfg)
        if issues:
            raise ConfigError(issues, f"{run_dir} (an existing run: it resumes with its own config)")
        return latest_checkpoint(checkpoint_root(cfg, run_dir))
    parent = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot create run directory {run_dir}: {parent} is not writable",
                        "pass --run-dir somewhere you can write")


def check_single_process() -> None:
    """Started by torchrun/srun with several processes, each would train alone into the same run directory."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise UserError(f"multi-process training (WORLD_SIZE={world}) is not supported yet",
                        "run forge train as a single process")


def check_device_support(cfg: JobConfig, device: torch.device) -> None:
    if device.type == "cpu" and cfg.model.sdpa_backend not in CPU_SDPA_BACKENDS:
        raise UserError(f"model.sdpa_backend = {cfg.model.sdpa_backend!r} has no CPU kernel",
                        f"use one of {', '.join(CPU_SDPA_BACKENDS)} on CPU")


@dataclass
class Job:
    """Everything the loop needs, built once before the first step."""

    cfg: JobConfig
    run_dir: Path
    device: torch.device
    dtype: torch.dtype
    model: Transformer
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    train_data: Any
    eval_data: Any
    summary: dict[str, Any]
    peak_flops: float | None
    start_step: int = 0
    tokens_seen: int = 0
    elapsed_sec: float = 0.0  # training time of earlier attempts of this run
    wandb_run_id: str | None = None

    def autocast(self) -> contextlib.AbstractContextManager:
        return precision.autocast(self.device, self.dtype)


def build_job(cfg: JobConfig, run_dir: Path) -> Job:
    from engine.data.loader import open_eval_data, open_train_data

    check_single_process()
    cfg = with_pinned_schedule(cfg.validate(world_size=1))
    train_data = open_train_data(cfg, dp_rank=0, dp_size=1)
    eval_data = open_eval_data(cfg, dp_rank=0, dp_size=1)
    resume_from = check_run_dir(cfg, run_dir)
    device = pick_device()
    check_device_support(cfg, device)
    dtype = precision.compute_dtype(cfg.train.mixed_precision, device)
    peak = peak_flops(device, dtype)

    seed_everything(cfg.train.seed)
    model = parallelize(MODELS.get(cfg.model.model_type)(cfg.model).to(device), cfg)
    optimizer = build_optimizer(model, cfg.optimizer)
    job = Job(cfg=cfg, run_dir=run_dir, device=device, dtype=dtype, model=model, optimizer=optimizer,
              scheduler=build_scheduler(optimizer, cfg.scheduler, cfg.train.max_steps),
              scaler=precision.grad_scaler(device, dtype), train_data=train_data, eval_data=eval_data,
              summary=job_summary(cfg), peak_flops=peak)
    if resume_from is not None:
        restore(job, resume_from[1])
    return job


def restore(job: Job, path: Path) -> None:
    """Continue from checkpoint `path`: the data position is the step, so nothing else needs saving."""
    state = load_checkpoint(path, job.model, job.optimizer)
    job.scheduler.load_state_dict(state["scheduler"])
    job.scaler.load_state_dict(state["grad_scaler"])
    restore_rng(state["rng"])
    job.start_step, job.tokens_seen, job.elapsed_sec = state["step"], state["tokens_seen"], state["elapsed_sec"]
    job.wandb_run_id = state["wandb_run_id"]
    log.info("resuming from %s", path)


def train_state(job: Job, step: int, tokens_seen: int, elapsed_sec: float, trackers: MetricsLogger) -> dict[str, Any]:
    """What a checkpoint holds beside the weights and optimizer; everything is JSON."""
    return {"step": step, "tokens_seen": tokens_seen, "elapsed_sec": elapsed_sec,
            "scheduler": job.scheduler.state_dict(), "grad_scaler": job.scaler.state_dict(), "rng": rng_state(),
            "wandb_run_id": trackers.wandb_run_id}


def open_run_dir(job: Job) -> MetricsLogger:
    """Write the run directory and start the metric sinks. A sink that cannot start (W&B not logged in,
    TensorBoard missing) is a user error: then whatever this call created is removed again."""
    created = not job.run_dir.exists()
    before = set() if created else set(job.run_dir.iterdir())
    try:
        job.run_dir.mkdir(parents=True, exist_ok=True)
        write_if_changed(job.run_dir / RUN_CONFIG, dump_toml(job.cfg).encode())
        if job.train_data.tokenizer_file is not None:
            write_if_changed(job.run_dir / "tokenizer.json", job.train_data.tokenizer_file.read_bytes())
        resumed_from = job.start_step if (job.run_dir / "metrics.jsonl").exists() and not created else None
        return build_trackers(job.cfg, job.run_dir, job.run_dir.name, resumed_from, job.wandb_run_id)
    except UserError:
        for path in [job.run_dir] if created else set(job.run_dir.iterdir()) - before:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        raise


def write_if_changed(path: Path, content: bytes) -> None:
    """A resume rewrites nothing it need not; what it does rewrite is replaced atomically, since the run's
    config is what a later resume reads."""
    if not path.is_file() or path.read_bytes() != content:
        write_durably(path, content)


def train(cfg: JobConfig, run_dir: Path, reporter: Reporter | None = None) -> dict[str, Any]:
    """Train `cfg` into `run_dir`, or continue the run there; return the final summary."""
    job = build_job(cfg, run_dir)
    if job.start_step >= cfg.train.max_steps:
        return {"steps": job.start_step, "tokens_seen": job.tokens_seen, "already_complete": True,
                "run_dir": str(run_dir)}
    trackers = open_run_dir(job)
    handler = logging.FileHandler(job.run_dir / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        return run_loop(job, trackers, reporter or SilentReporter())
    finally:
        trackers.close()
        log.removeHandler(handler)
        handler.close()


def train_step(job: Job, batches: Iterator, loss_fn) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One optimizer step over grad_accum_steps micro-batches; returns (mean loss, grad norm, lr used)."""
    accum = job.cfg.train.grad_accum_steps
    loss_sum = torch.zeros((), device=job.device)
    for _ in range(accum):
        inputs, labels = (t.to(job.device, non_blocking=True) for t in next(batches))
        with job.autocast():
            loss = loss_fn(job.model(inputs), labels) / accum
        job.scaler.scale(loss).backward()
        loss_sum += loss.detach()
    job.scaler.unscale_(job.optimizer)
    max_norm = job.cfg.train.grad_clip_norm or math.inf  # 0 = no clipping; the norm is still reported
    grad_norm = torch.nn.utils.clip_grad_norm_(job.model.parameters(), max_norm, foreach=True)
    lr = job.optimizer.param_groups[0]["lr"]
    job.scaler.step(job.optimizer)
    job.scaler.update()
    job.optimizer.zero_grad(set_to_none=True)
    job.scheduler.step()
    return loss_sum, grad_norm, lr


@torch.no_grad()
def evaluate(job: Job, loss_fn) -> dict[str, float]:
    job.model.eval()
    losses = []
    for inputs, labels in job.eval_data.batches():
        with job.autocast():
            losses.append(loss_fn(job.model(inputs.to(job.device)), labels.to(job.device)).item())
    job.model.train()
    loss = sum(losses) / len(losses)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 80.0))}


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


def run_loop(job: Job, trackers: MetricsLogger, reporter: Reporter) -> dict[str, Any]:
    cfg, t = job.cfg, job.cfg.train
    loss_fn = build_loss(t.loss_fn)
    ckpt_root = checkpoint_root(cfg, job.run_dir)
    tokens_per_step = job.summary["tokens_per_step"]
    profiler = ProfilerWindow(cfg.profiling, job.run_dir, job.device)
    info = {"run_dir": str(job.run_dir), "device": str(job.device), "dtype": str(job.dtype).removeprefix("torch."),
            "max_steps": t.max_steps, "start_step": job.start_step, **job.summary}
    reporter.on_start(info)
    log.info("start %s", info)

    batches = job.train_data.batches(start_step=job.start_step)
    job.model.train()
    tokens_seen, window = job.tokens_seen, ThroughputWindow()
    started = time.perf_counter() - job.elapsed_sec  # elapsed time counts earlier attempts of the run too
    last: dict[str, Any] = {}
    for step in range(job.start_step + 1, t.max_steps + 1):
        with profiler.step(step):
            loss, grad_norm, lr = train_step(job, batches, loss_fn)
        tokens_seen += tokens_per_step
        window.tokens += tokens_per_step
        if step == 1 or step % cfg.metrics.log_interval == 0 or step == t.max_steps:
            loss_value, norm_value = loss.item(), grad_norm.item()  # waits for the device, so the rate is true
            last = step_metrics(job, step, loss_value, norm_value, lr, window.rate(), tokens_seen, started)
            trackers.log(step, last)
            reporter.on_log(step, last)
            log.info("step %d loss %.4f lr %.3e grad_norm %.3f tokens/s %.0f", step, last["loss"], lr,
                     last["grad_norm"], last["tokens_per_sec"])
            window.reset()
        if job.eval_data is not None and (step % cfg.eval.interval == 0 or step == t.max_steps):
            with window.pause():
                metrics = evaluate(job, loss_fn)
            trackers.log(step, metrics)
            reporter.on_eval(step, metrics)
            log.info("eval step %d loss %.4f", step, metrics["eval_loss"])
            last.update(metrics)
        if step == t.max_steps or (cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0):
            with window.pause():
                path = save_checkpoint(ckpt_root, step, job.model, job.optimizer,
                                       train_state(job, step, tokens_seen, time.perf_counter() - started, trackers))
                prune_checkpoints(ckpt_root, cfg.checkpoint.keep_last_n)
            reporter.on_checkpoint(step, path)
            log.info("checkpoint %s", path)
    profiler.close(t.max_steps)
    summary = {"steps": t.max_steps, "start_step": job.start_step, "tokens_seen": tokens_seen, "train_time_sec": time.perf_counter() - started,
               "final_loss": last.get("loss"), "final_eval_loss": last.get("eval_loss"), "run_dir": str(job.run_dir)}
    reporter.on_end(summary)
    log.info("done %s", summary)
    return summary


def step_metrics(job: Job, step: int, loss: float, grad_norm: float, lr: float,
                 tokens_per_sec: float, tokens_seen: int, started: float) -> dict[str, Any]:
    return {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_sec": tokens_per_sec, "mfu": mfu(job.summary["flops_per_token"], tokens_per_sec, job.peak_flops),
            "tokens_seen": tokens_seen, "elapsed_sec": time.perf_counter() - started, **memory_stats(job.device)}
