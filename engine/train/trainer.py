"""The training loop: one process, or one of many (torchrun, srun, `forge train --nproc-per-node`).

`train(cfg, run_dir)` checks everything that can be wrong with the job (config, data, run directory)
before it writes anything, then trains, logs, evaluates and checkpoints. In a multi-process run every
rank runs this same loop on its part of the mesh (`engine.parallel`); rank 0 alone writes the run
directory, metrics and the checkpoint's train state, and decisions (skip a step, stop, save) are agreed
across ranks. A run directory that already
holds a run is resumed from its newest complete checkpoint, and the resumed run computes exactly what
the uninterrupted one would have: same weights, optimizer state, LR schedule, RNG and data position.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from engine.checkpoint.dcp import complete_checkpoints
from engine.checkpoint.manager import Checkpointer, initialize_from
from engine.checkpoint.rng import every_rank_rng_state, restore_rank_rng
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
from engine.model.moe import moe_metrics
from engine.model.transformer import Transformer
from engine.parallel.apply import float8_all_gather, parallelize
from engine.parallel.launch import device_for, join_process_group, leave_process_group
from engine.parallel.place import ProcessPlace, process_place
from engine.parallel.grad_norm import clip_grad_norm
from engine.parallel.mesh import ParallelDims, ParallelMesh, build_mesh
from engine.parallel.pipeline import Pipeline, build_pipeline, stage_union
from engine.parallel.tp import loss_context, uses_loss_parallel
from engine.resilience.anomaly import StepGuard, TrainingDiverged
from engine.resilience.collectives import any_rank, distributed
from engine.resilience.health import check_collectives
from engine.resilience.signals import Preempted, StopRequest
from engine.run_lock import RunLock
from engine.train import precision
from engine.train.balancing import attach_router_balancing
from engine.train.hooks import TrainHooks
from engine.train.losses import ModelLoss, StageCrossEntropy, build_loss
from engine.train.optim import build_optimizer, current_lr, eval_mode
from engine.train.profiling import ProfilerWindow
from engine.train.reporting import Reporter, SilentReporter
from engine.train.schedules import build_scheduler, default_decay_steps
from engine.train.summary import job_summary

log = logging.getLogger("forge.train")
IDENTITY_SAMPLE_TOKENS = 4096


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
    decay = default_decay_steps(cfg.scheduler, cfg.train.max_steps)
    return cfg.model_copy(update={"scheduler": cfg.scheduler.model_copy(update={"decay_steps": decay})})


def check_run_dir(cfg: JobConfig, run_dir: Path) -> bool:
    """A new run directory (False), or an existing run that `cfg` may continue (True; it resumes from its
    newest readable checkpoint, or from step 0 if it was killed before its first one)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} is a file", "pass --run-dir with a folder path")
    if (run_dir / RUN_CONFIG).is_file():
        issues = resume_issues(load_job_config(run_dir / RUN_CONFIG), cfg)
        if issues:
            raise ConfigError(issues, f"{run_dir} (an existing run: it resumes with its own config)")
        return True
    parent = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot create run directory {run_dir}: {parent} is not writable",
                        "pass --run-dir somewhere you can write")
    return False


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
    data_identity: str  # what a resume checks the training data against (`data_identity`)
    summary: dict[str, Any]
    peak_flops: float | None
    checkpointer: Checkpointer
    guard: StepGuard
    place: ProcessPlace = ProcessPlace(0, 0, 1)
    mesh: ParallelMesh | None = None
    pipeline: Pipeline | None = None  # pipeline parallelism: `model` is then this rank's stages (`stage_union`)
    float8_all_gather: bool = False  # FSDP gathers float8 weights: their scales are computed after each update
    loss_parallel: bool = False  # the logits stay vocabulary-sharded over the tensor-parallel ranks
    model_metrics: tuple[Callable[[], dict[str, float]], ...] = ()  # logged with each step's (MoE routing)
    start_step: int = 0
    tokens_seen: int = 0
    elapsed_sec: float = 0.0  # training time of earlier attempts of this run
    wandb_run_id: str | None = None
    run_lock: RunLock | None = None  # rank 0's, while it writes the run directory

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes the run directory and reports."""
        return self.place.rank == 0

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.mesh is not None and self.mesh.fsdp is not None:
            return contextlib.nullcontext()  # FSDP gathers the weights in the compute dtype itself
        return precision.autocast(self.device, self.dtype)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Around forward, loss and backward: cross-entropy on vocabulary-sharded logits under loss parallel."""
        return loss_context(self.loss_parallel)


def data_parallel_rank(dims: ParallelDims, rank: int) -> int:
    """This rank's index among the ranks that read different data, from the mesh's dimension order
    (pp, dp_replicate, dp_shard, cp, tp; tp innermost): known before any process group exists, so the
    data is checked before a process group starts."""
    return rank // (dims.cp * dims.tp) % dims.dp


def build_job(cfg: JobConfig, run_dir: Path) -> Job:
    """Everything checkable is checked before the process group starts and before anything is written."""
    from engine.data.loader import open_eval_data, open_train_data

    place = process_place()
    cfg = with_pinned_schedule(cfg.validate(world_size=place.world_size))
    dims = ParallelDims.from_config(cfg.distributed, place.world_size)
    dp_rank = data_parallel_rank(dims, place.rank)
    train_data = open_train_data(cfg, dp_rank=dp_rank, dp_size=dims.dp)
    eval_data = open_eval_data(cfg, dp_rank=dp_rank, dp_size=dims.dp, train=train_data)
    resuming = check_run_dir(cfg, run_dir)
    device = device_for(place)
    check_device_support(cfg, device)
    dtype = precision.compute_dtype(cfg.train.mixed_precision, device)

    mesh = None
    if place.world_size > 1:
        join_process_group(cfg.distributed.backend, cfg.distributed.nccl_timeout_sec, device)
        mesh = build_mesh(dims, device.type)
        assert mesh.dp_rank == dp_rank, "data_parallel_rank disagrees with the mesh"
    starts_fresh = not (resuming and complete_checkpoints(checkpoint_root(cfg, run_dir)))
    if mesh is None:
        model = parallelize(initial_model(cfg, starts_fresh).to(device), cfg)
        pipeline = None
    else:
        model, pipeline = distributed_model(cfg, mesh, device, starts_fresh, place.rank == 0)
    optimizer = build_optimizer(model, cfg.optimizer)
    job = Job(cfg=cfg, run_dir=run_dir, device=device, dtype=dtype, model=model, optimizer=optimizer,
              scheduler=build_scheduler(optimizer, cfg.scheduler, cfg.train.max_steps),
              scaler=precision.grad_scaler(device, dtype), train_data=train_data, eval_data=eval_data,
              data_identity=data_identity(train_data),
              summary=job_summary(cfg, place.world_size), peak_flops=peak_flops(device, dtype),
              checkpointer=Checkpointer(checkpoint_root(cfg, run_dir), cfg.checkpoint, device),
              guard=StepGuard(cfg.train), place=place, mesh=mesh, pipeline=pipeline,
              float8_all_gather=float8_all_gather(cfg, mesh, device),
              loss_parallel=uses_loss_parallel(dims.tp, cfg.train.loss_fn, dims.pp),
              model_metrics=moe_training(model, cfg, mesh))
    restored = job.checkpointer.restore(model, optimizer) if resuming else None
    if restored is not None:
        restore(job, *restored)
    refresh_float8_scales(job)
    return job


def moe_training(model: Transformer, cfg: JobConfig, mesh: ParallelMesh | None) -> tuple[Callable, ...]:
    """What training adds to an MoE model (which is never pipelined, so `model` is the whole Transformer):
    the routers' balancing, over the global batch under data parallelism; → its routing metrics' reporter."""
    if not cfg.model.is_moe:
        return ()
    attach_router_balancing(model, mesh.dp.get_group() if mesh is not None and mesh.dp is not None else None)
    return (partial(moe_metrics, model),)


def initial_model(cfg: JobConfig, starts_fresh: bool) -> Transformer:
    """The whole model, on the CPU, with the weights a run starts from: the seed's, or `checkpoint.load_path`'s
    for a new run (a resumed one loads its checkpoint later)."""
    seed_everything(cfg.train.seed)
    model = MODELS.get(cfg.model.model_type)(cfg.model)
    if starts_fresh and cfg.checkpoint.load_path is not None:
        initialize_from(Path(cfg.checkpoint.load_path), model, cfg.checkpoint.exclude_from_loading)
    return model


def distributed_model(cfg: JobConfig, mesh: ParallelMesh, device: torch.device, starts_fresh: bool,
                      is_main: bool) -> tuple[torch.nn.Module, Pipeline | None]:
    """This rank's part of the model, with the initial weights of a single-process run. Only rank 0 ever
    holds the whole model, in CPU memory: every rank builds it on the meta device (no memory), applies its
    layout, allocates its own shards, and receives their values from rank 0's copy, one tensor at a time
    (`set_model_state_dict` with `broadcast_from_rank0`). A resumed run skips all that: its checkpoint fills
    every shard. → (model or union of stages, pipeline or None)."""
    full_state = initial_state_on_main(cfg, is_main) if starts_fresh else None
    seed_everything(cfg.train.seed)
    with torch.device("meta"):
        model = MODELS.get(cfg.model.model_type)(cfg.model)
    pipeline = None
    if cfg.distributed.pp > 1:
        pipeline = pipelined(model, cfg, mesh, device)
        parts, model = pipeline.model_parts, stage_union(pipeline.model_parts)
    else:
        parts = [parallelize(model, cfg, mesh, device=device)]
        model = parts[0]
    for part in parts:
        part.to_empty(device=device)
        part.reset_rope_tables()
    if full_state is not None:
        missing = set(get_model_state_dict(model)) - set(full_state["names"])
        assert not missing, f"rank 0's model lacks {sorted(missing)[:5]}: they would keep uninitialised memory"
        set_model_state_dict(model, full_state["tensors"], options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, strict=False))  # each rank takes its own keys
    return model, pipeline


def initial_state_on_main(cfg: JobConfig, is_main: bool) -> dict[str, Any]:
    """Rank 0 builds the initial model; every rank learns whether that worked (a rank 0 that fails, e.g. on a
    bad checkpoint.load_path, must not leave the others waiting in the broadcast) and which names it has.
    → {"names": [...], "tensors": rank 0's state dict, empty elsewhere}."""
    tensors, failure = {}, None
    if is_main:
        try:
            tensors = initial_model(cfg, True).state_dict()
        except Exception as err:
            failure = err
    announced = [None if failure else sorted(tensors)]
    torch.distributed.broadcast_object_list(announced, src=0)
    if failure is not None:
        raise failure
    if announced[0] is None:
        raise UserError("rank 0 could not build the initial model", "see rank 0's error above")
    return {"names": announced[0], "tensors": tensors}


def pipelined(model: Transformer, cfg: JobConfig, mesh: ParallelMesh, device: torch.device) -> Pipeline:
    """This rank's pipeline stages, each parallelized like a whole model would be. The pipeline's
    micro-batches are the step's `train.grad_accum_steps` micro-batches."""
    loss = StageCrossEntropy(cfg.train.z_loss_weight)
    return build_pipeline(model, mesh.get("pp"), cfg.distributed.pp_schedule, cfg.train.grad_accum_steps, loss, device,
                          parallelize_stage=lambda part: parallelize(part, cfg, mesh, device=device, pipelined=True))


def restore(job: Job, path: Path, state: dict[str, Any]) -> None:
    """Continue from checkpoint `path` (weights and optimizer already loaded, `state` its train state): the
    data position is the step, so nothing else needs saving."""
    check_global_batch(job, path, state)
    check_same_data(job, path, state)
    if "guard" in state:  # checkpoints written before the bad-step detector existed have none
        job.guard.load_state_dict(state["guard"])
    job.scheduler.load_state_dict(state["scheduler"])
    job.scaler.load_state_dict(state["grad_scaler"])
    restore_rank_rng(state["rng"])
    job.start_step, job.tokens_seen, job.elapsed_sec = state["step"], state["tokens_seen"], state["elapsed_sec"]
    job.wandb_run_id = state["wandb_run_id"]
    log.info("resuming from %s", path)


def check_global_batch(job: Job, path: Path, state: dict[str, Any]) -> None:
    """A run may resume under another layout, but with the global batch it trained with."""
    tokens_per_step = job.summary["tokens_per_step"]
    # Checkpoints from before tokens_per_step was saved: every step so far had the same number of tokens.
    saved = state.get("tokens_per_step") or state["tokens_seen"] // max(state["step"], 1)
    if saved == tokens_per_step:
        return
    t = job.cfg.train
    per_device = saved / (t.seq_len * t.grad_accum_steps * job.summary["data_parallel"])
    hint = (f"set --train.batch_size={int(per_device)} for this layout" if per_device.is_integer() and per_device >= 1
            else "choose a layout and train.batch_size × grad_accum_steps that give the same global batch")
    raise UserError(f"{path} was trained with {saved} tokens per step, but this layout gives {tokens_per_step} "
                    "(train.batch_size × grad_accum_steps × data-parallel ranks × seq_len)", hint)


def check_same_data(job: Job, path: Path, state: dict[str, Any]) -> None:
    """A resumed run reads the samples the uninterrupted one would have: the data must be the same shards.
    Every rank checks its own view and they agree, so no rank goes on alone. (Checkpoints from before the
    data was recorded are not checked.)"""
    differs = state.get("data") not in (None, job.data_identity)
    if not any_rank(differs, job.device):
        return
    raise UserError(f"{path} was trained on other data than {job.train_data.directory} holds now "
                    "(another tokenizer, other shards, or other tokens in them)",
                    "point data.dataset_path (or data.hf_dataset_name, with data.hf_dataset_revision for a Hub "
                    "dataset) at the data the run trained on, or train into a new --run-dir")


def data_identity(train_data: Any) -> str:
    """The training data as a resume must find it again: the tokenizer, and for every shard training reads
    its length and first and last IDENTITY_SAMPLE_TOKENS tokens (so reordered or replaced text of the same
    length is caught without reading the whole data set). Where the text came from, the file format and
    the file names are left out: tokenized again from the same text, or moved, it is the same data."""
    m = train_data.manifest
    digest = hashlib.sha256(json.dumps([m.tokenizer_sha256, m.vocab_size, m.eos_id, m.dtype]).encode())
    for tokens in train_data.dataset.arrays:
        digest.update(len(tokens).to_bytes(8, "little"))
        digest.update(np.ascontiguousarray(tokens[:IDENTITY_SAMPLE_TOKENS]).tobytes())
        digest.update(np.ascontiguousarray(tokens[-IDENTITY_SAMPLE_TOKENS:]).tobytes())
    return digest.hexdigest()[:16]


def train_state(job: Job, step: int, tokens_seen: int, elapsed_sec: float, trackers: MetricsLogger) -> dict[str, Any]:
    """What a checkpoint holds beside the weights and optimizer; everything is JSON."""
    return {"step": step, "tokens_seen": tokens_seen, "elapsed_sec": elapsed_sec,
            "tokens_per_step": job.summary["tokens_per_step"], "data": job.data_identity,
            "scheduler": job.scheduler.state_dict(), "grad_scaler": job.scaler.state_dict(),
            "rng": every_rank_rng_state(),
            "wandb_run_id": trackers.wandb_run_id, "guard": job.guard.state_dict()}


def open_run_dir(job: Job) -> MetricsLogger:
    """Write the run directory and start the metric sinks. A sink that cannot start (W&B not logged in,
    TensorBoard missing) is a user error: then whatever this call created is removed again."""
    created = not job.run_dir.exists()
    before = set() if created else set(job.run_dir.iterdir())
    job.run_dir.mkdir(parents=True, exist_ok=True)
    job.run_lock = RunLock.acquire(job.run_dir)  # before anything is written; in use: nothing here is ours
    try:
        write_if_changed(job.run_dir / RUN_CONFIG, dump_toml(job.cfg).encode())
        if job.train_data.tokenizer_file is not None:
            write_if_changed(job.run_dir / "tokenizer.json", job.train_data.tokenizer_file.read_bytes())
            # The end-of-text token the shards were made with, where Hugging Face tools (and our export and
            # generate) look for it: a vocabulary can hold several candidates.
            eos = json.dumps({"eos_token": job.train_data.manifest.eos_token}, indent=2) + "\n"
            write_if_changed(job.run_dir / "tokenizer_config.json", eos.encode())
        resumed_from = job.start_step if (job.run_dir / "metrics.jsonl").exists() and not created else None
        return build_trackers(job.cfg, job.run_dir, job.run_dir.name, resumed_from, job.wandb_run_id)
    except UserError:
        for path in [job.run_dir] if created else set(job.run_dir.iterdir()) - before:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        release_run_dir(job)
        raise


def release_run_dir(job: Job) -> None:
    if job.run_lock is not None:
        job.run_lock.release()
        job.run_lock = None


def write_if_changed(path: Path, content: bytes) -> None:
    """A resume rewrites nothing it need not; what it does rewrite is replaced atomically, since the run's
    config is what a later resume reads."""
    if not path.is_file() or path.read_bytes() != content:
        write_durably(path, content)


def train(cfg: JobConfig, run_dir: Path, reporter: Reporter | None = None,
          hooks: TrainHooks | None = None) -> dict[str, Any]:
    """Train `cfg` into `run_dir`, or continue the run there; return the final summary.

    Raises `Preempted` after an emergency checkpoint when SIGTERM/SIGUSR1 arrives, `TrainingDiverged`
    when rollbacks cannot recover the loss, `CollectiveTimeout` when a rank stops answering,
    `CheckpointWriteError` when a checkpoint cannot be written."""
    with StopRequest(cfg.train.shutdown_timeout_sec).installed() as stop, process_group_released():
        job = build_job(cfg, run_dir)  # a signal during setup counts too
        if job.start_step >= cfg.train.max_steps:
            return {"steps": job.start_step, "tokens_seen": job.tokens_seen, "already_complete": True,
                    "run_dir": str(run_dir)}
        trackers = open_run_dir_on_main(job)
        with logging_to(job.run_dir / "train.log") if job.is_main else contextlib.nullcontext():
            try:
                return run_loop(job, trackers, (reporter or SilentReporter()) if job.is_main else SilentReporter(),
                                hooks or TrainHooks(), stop)
            except BaseException:
                finish_pending_save(job)
                raise
            finally:
                trackers.close()
                release_run_dir(job)


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


def open_run_dir_on_main(job: Job) -> MetricsLogger:
    """Rank 0 writes the run directory; the others log nothing. If rank 0 cannot (W&B not logged in), every
    rank stops, instead of the others waiting in the first collective until the timeout."""
    if job.place.world_size == 1:
        return open_run_dir(job)
    trackers, failure = MetricsLogger([]), None
    if job.is_main:
        try:
            trackers = open_run_dir(job)
        except Exception as err:  # any failure: the other ranks must not wait for rank 0 in a collective
            failure = err
    if any_rank(failure is not None, job.device):
        raise failure or UserError("rank 0 could not open the run directory", "see rank 0's error above")
    return trackers


@contextlib.contextmanager
def logging_to(path: Path) -> Iterator[None]:
    """Forge's log lines (training, checkpoints, resilience) also go to the run's train.log."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    forge_log = logging.getLogger("forge")
    forge_log.addHandler(handler)
    forge_log.setLevel(logging.INFO)
    try:
        yield
    finally:
        forge_log.removeHandler(handler)
        handler.close()


def finish_pending_save(job: "Job") -> None:
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


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    problem: str | None  # why the update was skipped; None when it was applied


def train_step(job: Job, step: int, batches: Iterator, loss_fn, hooks: TrainHooks) -> StepResult:
    """One optimizer step over grad_accum_steps micro-batches, or none when the step is bad (non-finite,
    or a loss spike): its batches are then consumed without an update, on every rank alike."""
    hooks.before_step(step, job)
    if job.pipeline is not None:
        loss_sum = pipeline_forward_backward(job, batches)
    else:
        loss_sum = forward_backward(job, batches, loss_fn)
    hooks.after_backward(step, job)
    job.scaler.unscale_(job.optimizer)
    max_norm = job.cfg.train.grad_clip_norm or math.inf  # 0 = no clipping; the norm is still reported
    grad_norm = clip_grad_norm(job.model.parameters(), max_norm, job.pipeline.group if job.pipeline else None)
    lr = current_lr(job.optimizer)
    loss_value, norm_value = torch.stack([mean_over_ranks(loss_sum), grad_norm.float()]).tolist()  # the one sync per step
    problem = job.guard.problem(loss_value, norm_value, scaler_handles_overflow=job.scaler.is_enabled())
    if any_rank(problem is not None, job.device):
        problem = problem or "a bad step on another rank"
        if job.scaler.is_enabled():
            job.scaler.update()  # closes the unscale_ above without stepping
    else:
        job.checkpointer.wait_for_staging()  # a background save must hold its copy before weights change
        job.scaler.step(job.optimizer)
        job.scaler.update()
        refresh_float8_scales(job)
        job.guard.accept(loss_value)
    job.optimizer.zero_grad(set_to_none=True)
    job.scheduler.step()
    return StepResult(loss_value, norm_value, lr, problem)


def refresh_float8_scales(job: Job) -> None:
    """Under FSDP's float8 all-gather the weights' scales are computed once per weight change (one
    all-reduce), after each update, restore and rollback."""
    if job.float8_all_gather:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(job.model)


def forward_backward(job: Job, batches: Iterator, loss_fn: ModelLoss) -> torch.Tensor:
    """Gradients of the step's mean loss, accumulated over its micro-batches; → that loss (not synced)."""
    accum = job.cfg.train.grad_accum_steps
    loss_sum = torch.zeros((), device=job.device)
    for _ in range(accum):
        inputs, labels = (t.to(job.device, non_blocking=True) for t in next(batches))
        with job.loss_context():
            with job.autocast():
                loss = loss_fn(job.model, inputs, labels) / accum
            job.scaler.scale(loss).backward()
        loss_sum += local_value(loss.detach())
    return loss_sum


def pipeline_forward_backward(job: Job, batches: Iterator) -> torch.Tensor:
    """The same through the pipeline schedule, which takes the step's micro-batches at once and splits them
    again; → the loss, on every pipeline rank."""
    micro = [next(batches) for _ in range(job.cfg.train.grad_accum_steps)]
    inputs, labels = (torch.cat(parts).to(job.device, non_blocking=True) for parts in zip(*micro))
    with job.autocast():
        loss = job.pipeline.step(inputs, labels)
    return job.pipeline.broadcast_loss(loss, job.device)


def local_value(value: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (under loss parallel it is a replicated DTensor)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of a per-rank loss over all ranks: the data-parallel mean (tensor-parallel ranks hold equal
    copies, which does not change a mean)."""
    if not distributed():
        return value
    value = value.detach().clone()
    torch.distributed.all_reduce(value)  # a sum: gloo has no average
    return value / torch.distributed.get_world_size()


@torch.no_grad()
def evaluate(job: Job, loss_fn: ModelLoss) -> dict[str, float]:
    """Plain cross-entropy (no z-loss) on the held-out batches, at the optimizer's evaluation weights."""
    job.model.eval()
    with eval_mode(job.optimizer):
        losses = pipeline_eval_losses(job) if job.pipeline is not None else eval_losses(job, loss_fn)
    job.model.train()
    loss = mean_over_ranks(torch.stack(losses).mean()).item()
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 80.0))}


def eval_losses(job: Job, loss_fn: ModelLoss) -> list[torch.Tensor]:
    losses = []
    for inputs, labels in job.eval_data.batches():
        with job.loss_context(), job.autocast():
            loss = loss_fn(job.model, inputs.to(job.device), labels.to(job.device), z_loss=False)
        losses.append(local_value(loss))
    return losses


def pipeline_eval_losses(job: Job) -> list[torch.Tensor]:
    """The held-out batches through the pipeline schedule, forward only, `grad_accum_steps` of them per pass
    (its microbatches: validation makes eval.steps a multiple); → each pass's mean loss, on every rank."""
    batches, n = list(job.eval_data.batches()), job.cfg.train.grad_accum_steps
    stage_loss = job.pipeline.loss_fn
    assert isinstance(stage_loss, StageCrossEntropy), "the trainer builds its pipelines with this loss"
    losses = []
    with stage_loss.plain():
        for first in range(0, len(batches), n):
            inputs, labels = (torch.cat(parts).to(job.device) for parts in zip(*batches[first:first + n]))
            with job.autocast():
                loss = job.pipeline.evaluate(inputs, labels)
            losses.append(job.pipeline.broadcast_loss(loss, job.device))
    return losses


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


def run_loop(job: Job, trackers: MetricsLogger, reporter: Reporter, hooks: TrainHooks, stop: StopRequest) -> dict[str, Any]:
    cfg, t = job.cfg, job.cfg.train
    loss_fn = build_loss(t)
    tokens_per_step = job.summary["tokens_per_step"]
    profiler = ProfilerWindow(cfg.profiling, job.run_dir, job.device)
    info = {"run_dir": str(job.run_dir), "device": str(job.device), "dtype": str(job.dtype).removeprefix("torch."),
            "max_steps": t.max_steps, "start_step": job.start_step, **job.summary}
    reporter.on_start(info)
    log.info("start %s", info)
    monitor = torch.distributed.new_group(backend="gloo") if t.nccl_health_check_interval and distributed() else None

    batches = job.train_data.batches(start_step=job.start_step)
    job.model.train()
    tokens_seen, window = job.tokens_seen, ThroughputWindow()
    started = time.perf_counter() - job.elapsed_sec  # elapsed time counts earlier attempts of the run too

    def checkpoint_done(done: tuple[int, Path] | None) -> None:
        if done is not None:
            reporter.on_checkpoint(*done)
            log.info("checkpoint %s", done[1])

    def save(step: int) -> None:
        with window.pause():
            state = train_state(job, step, tokens_seen, time.perf_counter() - started, trackers)
            path = job.checkpointer.save(step, job.model, job.optimizer, state)  # None: finishes in the background
        if path is not None:
            checkpoint_done((step, path))

    last: dict[str, Any] = {}
    for step in range(job.start_step + 1, t.max_steps + 1):
        with profiler.step(step):
            result = train_step(job, step, batches, loss_fn, hooks)
        tokens_seen += tokens_per_step
        window.tokens += tokens_per_step
        checkpoint_done(job.checkpointer.poll())
        if result.problem is not None:
            log.warning("step %d skipped: %s", step, result.problem)
            if job.guard.reject():
                with window.pause():
                    roll_back(job, step, f"{t.max_bad_steps} bad steps in a row")
        if step == 1 or step % cfg.metrics.log_interval == 0 or step == t.max_steps:
            last = step_metrics(job, step, result, window.rate(), tokens_seen, started)
            trackers.log(step, last)
            reporter.on_log(step, last)
            log.info("step %d loss %.4f lr %.3e grad_norm %.3f tokens/s %.0f", step, last["loss"], result.lr,
                     last["grad_norm"], last["tokens_per_sec"])
            window.reset()
        if job.eval_data is not None and (step % cfg.eval.interval == 0 or step == t.max_steps):
            with window.pause():
                metrics = evaluate(job, loss_fn)
            trackers.log(step, metrics)
            reporter.on_eval(step, metrics)
            log.info("eval step %d loss %.4f", step, metrics["eval_loss"])
            last.update(metrics)
        if t.nccl_health_check_interval and monitor is not None and step % t.nccl_health_check_interval == 0:
            check_collectives(cfg.distributed.nccl_timeout_sec, job.device, monitor)
        preempted = any_rank(stop.requested, job.device) and step < t.max_steps  # the last step just finishes
        if job.checkpointer.due(step, t.max_steps) or (preempted and not job.checkpointer.has(step)):
            if any_rank(not weights_finite(job.model), job.device):  # never checkpoint non-finite weights
                log.error("step %d: non-finite weights; rolling back instead of saving them", step)
                with window.pause():
                    roll_back(job, step, "non-finite weights")
            if job.guard.consecutive_bad and step < t.max_steps and not preempted:
                # Skipped steps leave the weights as they were, so this checkpoint would repeat the last
                # good one and make the next rollback a no-op: wait for a good step.
                log.warning("step %d: checkpoint postponed during a run of bad steps", step)
            else:
                save(step)
        if preempted:
            checkpoint_done(job.checkpointer.wait())
            path = job.checkpointer.root / f"step_{step}"
            raise Preempted(stop.signal_name or "a signal on another rank", step, str(path) if path.exists() else None)
    checkpoint_done(job.checkpointer.wait())
    profiler.close(t.max_steps)
    summary = {"steps": t.max_steps, "start_step": job.start_step, "tokens_seen": tokens_seen, "train_time_sec": time.perf_counter() - started,
               "final_loss": last.get("loss"), "final_eval_loss": last.get("eval_loss"), **job.guard.metrics(),
               "run_dir": str(job.run_dir)}
    reporter.on_end(summary)
    log.info("done %s", summary)
    return summary


def weights_finite(model: torch.nn.Module) -> bool:
    """This rank's shards only: callers agree over ranks."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return bool(torch.stack([p.detach().isfinite().all() for p in local]).all())


def roll_back(job: Job, step: int, reason: str) -> None:
    """Reload the last checkpoint's weights and optimizer state and go on with the next batches. The LR
    schedule keeps its place (the optimizer's restored LR is put back)."""
    lrs = [group["lr"] for group in job.optimizer.param_groups]
    if job.guard.rollbacks >= job.cfg.train.max_rollbacks:
        job.guard.rolled_back(reason, None)  # raises TrainingDiverged
    restored = job.checkpointer.rollback(job.model, job.optimizer)
    if restored is None:
        raise TrainingDiverged(f"{reason} at step {step}, before the first checkpoint, so there is nothing to "
                               "roll back to; lower optimizer.lr or check the data")
    job.guard.rolled_back(reason, restored[1])
    refresh_float8_scales(job)
    for group, lr in zip(job.optimizer.param_groups, lrs):
        group["lr"] = lr
    log.warning("step %d: %s; rolled back to %s (rollback %d of at most %d)", step, reason, restored[0],
                job.guard.rollbacks, job.cfg.train.max_rollbacks)


def step_metrics(job: Job, step: int, result: StepResult, tokens_per_sec: float, tokens_seen: int,
                 started: float) -> dict[str, Any]:
    world = job.place.world_size
    peak = None if job.peak_flops is None else job.peak_flops * world  # tokens/s is the whole job's
    return {"step": step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
            "tokens_per_sec": tokens_per_sec, "mfu": mfu(job.summary["flops_per_token"], tokens_per_sec, peak),
            "tokens_seen": tokens_seen, "elapsed_sec": time.perf_counter() - started, **job.guard.metrics(),
            **memory_per_rank(job.device), **{k: v for report in job.model_metrics for k, v in report().items()}}


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
