"""The training loop: one process, CPU or one GPU.

`train(cfg, run_dir)` checks everything that can be wrong with the job (config, data, run directory)
before it writes anything, then trains, logs, evaluates and checkpoints.
"""

from __future__ import annotations

import logging
import math
import random
import shutil
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from engine.checkpoint.dcp import prune_checkpoints, save_checkpoint, step_dirs
from engine.config.job import JobConfig
from engine.config.loader import dump_toml
from engine.errors import UserError
from engine.metrics.memory import memory_stats
from engine.metrics.mfu import mfu, peak_flops
from engine.metrics.trackers import build_trackers
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


def refuse_existing_run(cfg: JobConfig, run_dir: Path) -> None:
    """Never train over a run that already has checkpoints: that would mix two runs' files."""
    if step_dirs(checkpoint_root(cfg, run_dir)) or (run_dir / "metrics.jsonl").exists():
        raise UserError(f"run directory {run_dir} already holds a run",
                        "pass --run-dir with a new folder, or delete the old run; resuming arrives with `forge resume`")


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

    def autocast(self) -> AbstractContextManager:
        return precision.autocast(self.device, self.dtype)


def build_job(cfg: JobConfig, run_dir: Path) -> Job:
    from engine.data.loader import open_eval_data, open_train_data

    cfg.validate(world_size=1)
    train_data = open_train_data(cfg, dp_rank=0, dp_size=1)
    eval_data = open_eval_data(cfg, dp_rank=0, dp_size=1)
    refuse_existing_run(cfg, run_dir)

    device = pick_device()
    seed_everything(cfg.train.seed)
    model = parallelize(Transformer(cfg.model).to(device), cfg)
    optimizer = build_optimizer(model, cfg.optimizer)
    dtype = precision.compute_dtype(cfg.train.mixed_precision, device)
    return Job(cfg=cfg, run_dir=run_dir, device=device, dtype=dtype, model=model, optimizer=optimizer,
               scheduler=build_scheduler(optimizer, cfg.scheduler, cfg.train.max_steps),
               scaler=precision.grad_scaler(device, dtype), train_data=train_data, eval_data=eval_data,
               summary=job_summary(cfg))


def write_run_dir(job: Job) -> None:
    job.run_dir.mkdir(parents=True, exist_ok=True)
    (job.run_dir / "config.toml").write_text(dump_toml(job.cfg))
    if job.train_data.tokenizer_file is not None:
        shutil.copyfile(job.train_data.tokenizer_file, job.run_dir / "tokenizer.json")
    handler = logging.FileHandler(job.run_dir / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def train(cfg: JobConfig, run_dir: Path, reporter: Reporter | None = None) -> dict[str, Any]:
    """Train `cfg` into `run_dir`; return the final summary (last loss, steps, tokens, time)."""
    reporter = reporter or SilentReporter()
    job = build_job(cfg, run_dir)
    write_run_dir(job)
    try:
        return run_loop(job, reporter)
    finally:
        for handler in list(log.handlers):
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
    max_norm = job.cfg.train.grad_clip_norm or math.inf
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


def run_loop(job: Job, reporter: Reporter) -> dict[str, Any]:
    cfg, t = job.cfg, job.cfg.train
    loss_fn = build_loss(t.loss_fn)
    trackers = build_trackers(cfg, job.run_dir, job.run_dir.name)
    ckpt_root = checkpoint_root(cfg, job.run_dir)
    peak = peak_flops(job.device, job.dtype)
    tokens_per_step = job.summary["tokens_per_step"]
    profiler = ProfilerWindow(cfg.profiling, job.run_dir, job.device)
    info = {"run_dir": str(job.run_dir), "device": str(job.device), "dtype": str(job.dtype).removeprefix("torch."),
            "max_steps": t.max_steps, **job.summary}
    reporter.on_start(info)
    log.info("start %s", info)

    batches = job.train_data.batches(start_step=0)
    job.model.train()
    tokens_seen, window_start, window_tokens, started = 0, time.perf_counter(), 0, time.perf_counter()
    last: dict[str, float] = {}
    try:
        for step in range(1, t.max_steps + 1):
            with profiler.step(step):
                loss, grad_norm, lr = train_step(job, batches, loss_fn)
            tokens_seen += tokens_per_step
            window_tokens += tokens_per_step
            if step == 1 or step % cfg.metrics.log_interval == 0 or step == t.max_steps:
                elapsed = time.perf_counter() - window_start
                tokens_per_sec = window_tokens / elapsed
                last = {"step": step, "loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(),
                        "tokens_per_sec": tokens_per_sec, "mfu": mfu(job.summary["flops_per_token"], tokens_per_sec, peak),
                        "tokens_seen": tokens_seen, "elapsed_sec": time.perf_counter() - started,
                        **memory_stats(job.device)}
                trackers.log(step, last)
                reporter.on_log(step, last)
                log.info("step %d loss %.4f lr %.3e grad_norm %.3f tokens/s %.0f", step, last["loss"], lr,
                         last["grad_norm"], tokens_per_sec)
                window_start, window_tokens = time.perf_counter(), 0
            if job.eval_data is not None and (step % cfg.eval.interval == 0 or step == t.max_steps):
                metrics = evaluate(job, loss_fn)
                trackers.log(step, metrics)
                reporter.on_eval(step, metrics)
                log.info("eval step %d loss %.4f", step, metrics["eval_loss"])
                last.update(metrics)
            if step == t.max_steps or (cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0):
                path = save_checkpoint(ckpt_root, step, job.model, job.optimizer,
                                       {"step": step, "tokens_seen": tokens_seen, "scheduler": job.scheduler.state_dict()})
                prune_checkpoints(ckpt_root, cfg.checkpoint.keep_last_n)
                reporter.on_checkpoint(step, path)
                log.info("checkpoint %s", path)
    finally:
        trackers.close()
    summary = {"steps": t.max_steps, "tokens_seen": tokens_seen, "train_time_sec": time.perf_counter() - started,
               "final_loss": last.get("loss"), "final_eval_loss": last.get("eval_loss"), "run_dir": str(job.run_dir)}
    reporter.on_end(summary)
    log.info("done %s", summary)
    return summary
