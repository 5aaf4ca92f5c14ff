"""The job: everything the training loop needs, built and checked once before the first step.

`build_job` checks what can be wrong (config, data, run directory, device) before the process group
starts and before anything is written, then builds this rank's model (its part of the mesh, with the
weights of a single-process run), optimizer, schedule and data, and a resumed run's state from its
newest checkpoint (`restore`; `train_state` is what a checkpoint holds for it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from engine import precision
from engine.checkpoint.dcp import PARAMETRIZATION_KEY, TRAIN_STATE, complete_checkpoints, parametrization
from engine.checkpoint.layout import checkpoint_root, step_dirs
from engine.checkpoint.manager import Checkpointer, initialize_from
from engine.checkpoint.rng import every_rank_rng_state, restore_rank_rng
from engine.config.job import JobConfig
from engine.data.batch_plan import BatchPlan
from engine.errors import ConfigIssue, UserError
from engine.metrics.callback import LEGACY_WANDB_RUN_ID, with_legacy_states
from engine.metrics.mfu import peak_flops
from engine.model import build_model, materialize
from engine.model.documents import document_ids
from engine.model.lora import apply_lora
from engine.model.packed_kernel import CPU_SDPA_BACKENDS
from engine.model.routing_metrics import moe_metrics
from engine.model.spec import LanguageModel, spec_for
from engine.parallel.apply import float8_all_gather, parallelize
from engine.parallel.context import ContextParallel
from engine.parallel.float8 import float8_device_warnings
from engine.parallel.launch import device_for, join_process_group, join_single_process_group
from engine.parallel.mesh import ParallelDims, ParallelMesh, build_mesh
from engine.parallel.pipeline import Pipeline, StageShapes, build_pipeline, stage_union
from engine.parallel.pipeline_moe import pipeline_moe_metrics
from engine.parallel.place import ProcessPlace, process_place
from engine.parallel.tp import loss_context, uses_loss_parallel
from engine.plan import ResolvedJob, resolve
from engine.plan.length import as_given
from engine.plan.summary import job_summary
from engine.resilience.anomaly import StepGuard
from engine.resilience.collectives import any_rank, on_rank0
from engine.run_files import RUN_CONFIG
from engine.safe_paths import resolves_inside
from engine.train.balancing import attach_router_balancing
from engine.train.ema import STATE_KEY as EMA_KEY
from engine.train.ema import WeightAverage
from engine.train.losses import StageCrossEntropy, mtp_metrics
from engine.train.moe_load import ExpertLoadWindow
from engine.train.offload import activation_offload, offload_device_warnings
from engine.train.optim import build_optimizer
from engine.train.run_dir import check_run_dir
from engine.train.schedules import job_scheduler, schedule_state, with_pinned_schedule

log = logging.getLogger("forge.train")


@dataclass
class Job:
    """Everything the loop needs, built once before the first step."""

    cfg: JobConfig  # with the derived lengths filled in (engine/plan/length.py)
    run_dir: Path
    device: torch.device
    dtype: torch.dtype
    model: LanguageModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    train_data: Any
    eval_data: Any
    data_identity: str  # what a resume checks the training data against (`TrainData.identity`)
    summary: dict[str, Any]
    peak_flops: float | None
    checkpointer: Checkpointer
    guard: StepGuard
    place: ProcessPlace = ProcessPlace(0, 0, 1)
    mesh: ParallelMesh | None = None
    pipeline: Pipeline | None = None  # pipeline parallelism: `model` is then this rank's stages (`stage_union`)
    float8_all_gather: bool = False  # FSDP gathers float8 weights: their scales are computed after each update
    ema: WeightAverage | None = None  # the EMA of the weights (train.ema_decay), saved in every checkpoint
    loss_parallel: bool = False  # the logits stay vocabulary-sharded over the tensor-parallel ranks
    context: ContextParallel | None = None  # context parallelism: each rank keeps part of every sequence
    model_metrics: tuple[Callable[[], dict[str, float]], ...] = ()  # logged with each step's (MoE routing)
    record: JobConfig | None = None  # what the run directory records: `cfg` as the user gave it (as_given)
    batch_plan: BatchPlan | None = None  # each step's size (a batch ramp), from train.global_batch_size
    checkpoint_lock_dir: Path | None = None  # an absolute checkpoint.dir outside the run directory: locked with it
    start_step: int = 0
    tokens_seen: int = 0
    elapsed_sec: float = 0.0  # training time of earlier attempts of this run
    callback_states: dict[str, Any] = field(default_factory=dict)  # a resumed run's, by callback name
    warnings: tuple[ConfigIssue, ...] = ()  # what this device makes of the config, shown at the start (rank 0)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes the run directory and reports."""
        return self.place.rank == 0

    def autocast(self) -> contextlib.AbstractContextManager:
        if fsdp_casts(self.mesh):
            return contextlib.nullcontext()  # FSDP gathers the weights in the compute dtype itself
        return precision.autocast(self.device, self.dtype)

    def activation_offload(self) -> contextlib.AbstractContextManager:
        """Around forward and loss: the saved activations in host memory (train.activation_offload)."""
        return activation_offload(self.cfg, self.device)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Around forward, loss and backward: cross-entropy on vocabulary-sharded logits under loss parallel."""
        return loss_context(self.loss_parallel)

    def documents(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """With data.pack_sequences, the document ids of a micro-batch's windows (the model keeps attention and
        RoPE positions inside each document); None otherwise, which leaves the model's forward as it was. Of the
        whole windows, before `local_batch`: a cp rank's document boundaries may lie in another rank's part."""
        if not self.cfg.data.pack_sequences:
            return None
        return document_ids(tokens, self.train_data.manifest.eos_id)

    def local_batch(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What this rank trains on of a micro-batch: all of it, or under context parallelism its positions
        of every sequence (the cp ranks read the same batch; the model's hook supplies the positions)."""
        if self.context is None:
            return inputs, labels
        return self.context.shard(inputs), self.context.shard(labels)

    def refresh_float8_scales(self) -> None:
        """Under FSDP's float8 all-gather the weights' scales are computed once per weight change (one
        all-reduce), after each update, restore and rollback."""
        if self.float8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.model)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def check_checkpoint_root(cfg: JobConfig, run_dir: Path, resuming: bool) -> Path | None:
    """An absolute `checkpoint.dir` (outside the run directory, where the run lock does not reach) must be this
    run's own: not inside another run directory, and, for a new run, holding no checkpoints yet (a new run would
    replace and prune them). → the folder to lock beside the run directory, or None when the run lock covers it."""
    root = checkpoint_root(run_dir, cfg.checkpoint.dir)  # a relative one that leads out is refused here
    if not Path(cfg.checkpoint.dir).is_absolute():
        return None
    owner = next((p for p in (root, *root.parents) if (p / RUN_CONFIG).is_file()), None)
    if owner is not None and owner.resolve() != run_dir.resolve():
        raise UserError(
            f"checkpoint.dir = {cfg.checkpoint.dir!r} is inside another run directory, {owner}",
            "give this run a checkpoint folder of its own (the default is the run directory's checkpoints/)",
        )
    if not resuming and step_dirs(root):
        raise UserError(
            f"checkpoint.dir = {cfg.checkpoint.dir!r} already holds checkpoints, and this is a new run in {run_dir}",
            "give this run an empty checkpoint folder, or resume the run those checkpoints belong to",
        )
    return None if resolves_inside(root, run_dir) else root


def check_device_support(cfg: JobConfig, device: torch.device) -> None:
    if device.type == "cpu" and cfg.model.sdpa_backend not in CPU_SDPA_BACKENDS:
        raise UserError(
            f"model.sdpa_backend = {cfg.model.sdpa_backend!r} has no CPU kernel",
            f"use one of {', '.join(CPU_SDPA_BACKENDS)} on CPU",
        )


def data_parallel_rank(dims: ParallelDims, rank: int) -> int:
    """This rank's index among the ranks that read different data, from the mesh's dimension order
    (pp, dp_replicate, dp_shard, cp, tp; tp innermost): known before any process group exists, so the
    data is checked before a process group starts."""
    return rank // (dims.cp * dims.tp) % dims.dp


def build_job(cfg: JobConfig, run_dir: Path, resolved: ResolvedJob | None = None) -> Job:
    """Everything checkable is checked before the process group starts and before anything is written.
    `resolved`: what `cfg` resolved to for this world size, when the caller has it (the CLI, which shows its
    warnings first); otherwise it is resolved here."""
    from engine.data.loader import open_eval_data, open_train_data

    place = process_place()
    planned = resolve(cfg, place.world_size) if resolved is None else resolved
    assert planned.world_size == place.world_size, "a job resolved for another world size"
    given = planned.given
    cfg = with_pinned_schedule(planned.config, place.world_size)
    dims = ParallelDims.from_config(cfg.distributed, place.world_size)
    dp_rank = data_parallel_rank(dims, place.rank)
    train_data = open_train_data(cfg, dp_rank=dp_rank, dp_size=dims.dp)
    eval_data = open_eval_data(cfg, dp_rank=dp_rank, dp_size=dims.dp, train=train_data)
    record = as_given(cfg, given)
    resuming = check_run_dir(record, run_dir)
    checkpoint_lock_dir = check_checkpoint_root(cfg, run_dir, resuming)
    device = device_for(place)
    check_device_support(cfg, device)
    dtype = precision.compute_dtype(cfg.train.mixed_precision, device)

    mesh = None
    if place.world_size > 1:
        join_process_group(cfg.distributed.backend, cfg.distributed.nccl_timeout_sec, device)
        mesh = build_mesh(dims, device.type)
        assert mesh.dp_rank == dp_rank, "data_parallel_rank disagrees with the mesh"
    elif cfg.distributed.cpu_offload:  # FSDP2 offloads, and needs a process group (of this one process)
        join_single_process_group(cfg.distributed.backend, cfg.distributed.nccl_timeout_sec, device)
    starts_fresh = not (resuming and complete_checkpoints(checkpoint_root(run_dir, cfg.checkpoint.dir)))
    base_from_load_path = starts_fresh or base_rebuilt(cfg)
    if mesh is None:
        model = parallelize(initial_model(cfg, base_from_load_path).to(device), cfg, device=device)
        pipeline = None
    else:
        model, pipeline = distributed_model(cfg, mesh, device, base_from_load_path)
    optimizer = build_optimizer(model, cfg.optimizer)
    ema = WeightAverage.for_training(model, cfg.train)  # a resumed run's is filled by its checkpoint
    job = Job(
        cfg=cfg,
        run_dir=run_dir,
        device=device,
        dtype=dtype,
        model=model,
        optimizer=optimizer,
        scheduler=job_scheduler(optimizer, cfg, place.world_size),
        scaler=precision.grad_scaler(device, dtype),
        train_data=train_data,
        eval_data=eval_data,
        data_identity=train_data.identity(),
        summary=job_summary(planned),
        peak_flops=peak_flops(device, dtype),
        checkpointer=Checkpointer(
            checkpoint_root(run_dir, cfg.checkpoint.dir),
            cfg.checkpoint,
            device,
            {EMA_KEY: ema} if ema is not None else None,
            trainable_only=base_rebuilt(cfg),
        ),
        guard=StepGuard(cfg.train),
        place=place,
        mesh=mesh,
        pipeline=pipeline,
        float8_all_gather=float8_all_gather(cfg, mesh, device),
        ema=ema,
        loss_parallel=uses_loss_parallel(dims.tp, cfg.train.loss_fn, dims.pp),
        context=ContextParallel(mesh.get("cp")) if mesh is not None and dims.cp > 1 else None,
        model_metrics=moe_training(model, cfg, mesh, pipeline) + mtp_reporting(model, cfg, mesh, pipeline),
        warnings=(*float8_device_warnings(cfg.train.mixed_precision, device), *offload_device_warnings(cfg, device)),
        record=record,
        checkpoint_lock_dir=checkpoint_lock_dir,
        batch_plan=planned.batches,
    )
    restored = job.checkpointer.restore(model, optimizer) if resuming else None
    if restored is not None:
        restore(job, *restored)
    job.refresh_float8_scales()
    return job


def moe_training(
    model: LanguageModel, cfg: JobConfig, mesh: ParallelMesh | None, pipeline: Pipeline | None
) -> tuple[Callable, ...]:
    """What training adds to an MoE model: the routers' balancing, over the global batch under data
    parallelism, on the whole model or on each pipeline stage (each routes its own layers); → the reporter of
    its routing metrics, which a pipeline gathers from every stage."""
    if not cfg.model.is_moe:
        return ()
    group = mesh.dp.get_group() if mesh is not None and mesh.dp is not None else None
    window = ExpertLoadWindow(group)  # tokens per expert since the last logged step: the dead experts
    if pipeline is None:
        attach_router_balancing(model, group)
        window.attach(model)
        return (lambda: moe_metrics(model, window.take()),)
    for part in pipeline.model_parts:
        attach_router_balancing(part, group)
        window.attach(part)
    return (lambda: pipeline_moe_metrics(pipeline.model_parts, pipeline.gather, window.take()),)


def mtp_reporting(
    model: LanguageModel, cfg: JobConfig, mesh: ParallelMesh | None, pipeline: Pipeline | None
) -> tuple[Callable, ...]:
    """The reporter of the main and multi-token-prediction losses (a model with `model.mtp_depth` > 0),
    averaged over the data-parallel ranks; in a pipeline the last stage's loss keeps them (on its stage
    model), and every pipeline rank gets them from that stage's rank."""
    if not cfg.model.mtp_depth:
        return ()
    group = mesh.dp.get_group() if mesh is not None and mesh.dp is not None else None
    if pipeline is None:
        return (lambda: mtp_metrics(model, group),)
    return (
        lambda: pipeline.gather({k: v for part in pipeline.model_parts for k, v in mtp_metrics(part, group).items()}),
    )


def initial_model(cfg: JobConfig, starts_fresh: bool) -> LanguageModel:
    """The whole model, on the CPU, with the weights a run starts from: the seed's, or `checkpoint.load_path`'s
    for a new run (a resumed one loads its checkpoint later; one whose checkpoints lack the frozen base,
    `base_rebuilt`, passes starts_fresh = True to rebuild it). With `[lora]`, the loaded model is frozen and
    gets its adapters (engine/model/lora.py), before any parallelism is applied."""
    seed_everything(cfg.train.seed)
    model = build_model(cfg.model)
    if starts_fresh and cfg.checkpoint.load_path is not None:
        initialize_from(Path(cfg.checkpoint.load_path), model, cfg.checkpoint.exclude_from_loading)
    if cfg.lora.enabled:
        apply_lora(model, cfg.lora)
    if cfg.optimizer.weight_dtype == "bf16":  # trained in bf16 with stochastic rounding (engine/train/optim/adamw.py)
        precision.cast_weights(model, torch.bfloat16)
    return model


def base_rebuilt(cfg: JobConfig) -> bool:
    """Checkpoints hold only the trainable weights (lora.save_adapters_only): every attempt, resumed or not,
    rebuilds the frozen base as the first did (seed, then checkpoint.load_path), and the checkpoint fills in
    the adapters."""
    return cfg.lora.enabled and cfg.lora.save_adapters_only


def distributed_model(
    cfg: JobConfig, mesh: ParallelMesh, device: torch.device, starts_fresh: bool
) -> tuple[torch.nn.Module, Pipeline | None]:
    """This rank's part of the model, with the initial weights of a single-process run. Only rank 0 ever
    holds the whole model, in CPU memory: every rank builds it on the meta device (no memory), applies its
    layout, allocates its own shards, and receives their values from rank 0's copy, one tensor at a time
    (`set_model_state_dict` with `broadcast_from_rank0`). A resumed run skips all that: its checkpoint fills
    every shard. → (model or union of stages, pipeline or None)."""
    full_state = initial_state_on_main(cfg, device) if starts_fresh else None
    seed_everything(cfg.train.seed)
    with torch.device("meta"):
        model = build_model(cfg.model)
        if cfg.lora.enabled:  # the same module tree as rank 0's initial model
            apply_lora(model, cfg.lora)
    pipeline = None
    if cfg.distributed.pp > 1:
        pipeline = pipelined(model, cfg, mesh, device)
        parts, model = pipeline.model_parts, stage_union(pipeline.model_parts)
    else:
        parts = [parallelize(model, cfg, mesh, device=device)]
        model = parts[0]
    for part in parts:
        materialize(part, device)
    if full_state is not None:
        missing = set(get_model_state_dict(model)) - set(full_state["names"])
        assert not missing, f"rank 0's model lacks {sorted(missing)[:5]}: they would keep uninitialised memory"
        set_model_state_dict(
            model,
            full_state["tensors"],
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False),
        )  # each rank takes its own keys
    return model, pipeline


def initial_state_on_main(cfg: JobConfig, device: torch.device) -> dict[str, Any]:
    """Rank 0 builds the initial model; every rank learns whether that worked (a rank 0 that fails, e.g. on a
    bad checkpoint.load_path, must not leave the others waiting in the broadcast) and which names it has.
    → {"names": [...], "tensors": rank 0's state dict, empty elsewhere}."""
    tensors = on_rank0(lambda: initial_model(cfg, True).state_dict(), {}, device, "build the initial model")
    names = [sorted(tensors)]
    torch.distributed.broadcast_object_list(names, src=0)
    return {"names": names[0], "tensors": tensors}


def pipelined(model: LanguageModel, cfg: JobConfig, mesh: ParallelMesh, device: torch.device) -> Pipeline:
    """This rank's pipeline stages, each parallelized like a whole model would be. The pipeline's
    micro-batches are the step's `train.grad_accum_steps` micro-batches. The chunked loss projects the last
    stage's hidden states through that stage's head."""
    chunked = cfg.train.loss_fn == "chunked_cross_entropy"
    loss = StageCrossEntropy(cfg.train.z_loss_weight, cfg.train.ce_chunk_size if chunked else None)
    pipeline = build_pipeline(
        model,
        mesh.get("pp"),
        cfg.distributed.pp_schedule,
        cfg.train.grad_accum_steps,
        loss,
        device,
        stage_shapes(cfg, mesh, device),
        parallelize_stage=lambda part: parallelize(part, cfg, mesh, device=device, pipelined=True),
    )
    head = spec_for(cfg.model).parts.head_of
    last = next((part for part in pipeline.model_parts if head(part) is not None), None)  # on the last stage's rank
    if loss.takes_hidden and last is not None:
        loss.bind_head(head(last))
    if pipeline.predictions and last is not None:
        loss.bind_predictions(last)
    return pipeline


def fsdp_casts(mesh: ParallelMesh | None) -> bool:
    """FSDP casts the weights (and a module's inputs) to the compute dtype itself, so no autocast runs; the
    pipeline's declared stage shapes follow the same rule."""
    return mesh is not None and mesh.fsdp is not None


def stage_shapes(cfg: JobConfig, mesh: ParallelMesh, device: torch.device) -> StageShapes:
    """What this run's stages pass per micro-batch. The residual stream is in the dtype of the embedding's
    weight: the compute dtype under FSDP (which gathers the weights in it and casts a stage's inputs to it),
    else fp32 (autocast leaves the embedding and the residual adds in fp32); the head's logits are in the
    compute dtype either way. Sequence parallelism leaves each tp rank seq / tp positions between stages."""
    compute = precision.compute_dtype(cfg.train.mixed_precision, device)
    m, t = cfg.model, cfg.train
    return StageShapes(
        batch=t.batch_size,
        seq=t.seq_len,
        hidden_seq=t.seq_len // cfg.distributed.tp,
        dim=m.dim,
        vocab=m.vocab_size,
        hidden_dtype=compute if fsdp_casts(mesh) else torch.float32,
        logits_dtype=compute,
        last_hidden=cfg.train.loss_fn == "chunked_cross_entropy",
        predictions=m.mtp_depth,
    )


# What `restore` reads of a checkpoint's train_state.json (`train_state` writes it) and the JSON types each may
# hold; the optional ones are missing from checkpoints written before they existed.
COUNT = (int,)
TRAIN_STATE_FIELDS: dict[str, tuple[type, ...]] = {
    "step": COUNT,
    "tokens_seen": COUNT,
    "elapsed_sec": (int, float),
    "scheduler": (dict,),
    "grad_scaler": (dict,),
    "rng": (list, dict),  # a dict: rank 0's state alone, from before per-rank states
}
OPTIONAL_TRAIN_STATE_FIELDS: dict[str, tuple[type, ...]] = {
    "tokens_per_step": COUNT,
    "data": (str,),
    "guard": (dict,),
    EMA_KEY: (bool,),
    "callbacks": (dict,),  # each loop callback's state, by its name (engine/train/callbacks/base.py)
    LEGACY_WANDB_RUN_ID: (str, type(None)),  # before callbacks kept state: the W&B sink's run id
}


def check_train_state(path: Path, state: Any) -> None:
    """The train state has the keys and types `restore` reads, so that a train_state.json written by hand, by
    another tool or an incompatible version is named with its first wrong field, not a KeyError or TypeError
    halfway through restoring (its checksum only says the file is the one that was written)."""
    where = path / TRAIN_STATE
    fix = "resume from another checkpoint (checkpoint.load_path), or train into a new --run-dir"
    if not isinstance(state, dict):
        raise UserError(f"{where} holds a JSON {type(state).__name__}, not an object of the train state", fix)
    for key, kinds in (TRAIN_STATE_FIELDS | OPTIONAL_TRAIN_STATE_FIELDS).items():
        if key not in state:
            if key in TRAIN_STATE_FIELDS:
                raise UserError(f"{where} has no {key!r}", fix)
            continue
        value = state[key]
        if isinstance(value, bool) is not (bool in kinds) or not isinstance(value, kinds):
            allowed = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise UserError(f"{where}: {key!r} is {json.dumps(value)[:60]}, not {allowed}", fix)
        if kinds is COUNT and value < 0:
            raise UserError(f"{where}: {key!r} is {value}, not a count (>= 0)", fix)


def restore(job: Job, path: Path, state: dict[str, Any]) -> None:
    """Continue from checkpoint `path` (weights and optimizer already loaded, `state` its train state): the
    data position is the step, so nothing else needs saving."""
    check_train_state(path, state)
    check_global_batch(job, path, state)
    check_same_data(job, path, state)
    if "guard" in state:  # checkpoints written before the bad-step detector existed have none
        job.guard.load_state_dict(state["guard"])
    job.scheduler.load_state_dict(state["scheduler"])
    job.scaler.load_state_dict(state["grad_scaler"])
    if job.ema is not None:
        job.ema.after_load(state)
    restore_rank_rng(state["rng"])
    job.start_step, job.tokens_seen, job.elapsed_sec = state["step"], state["tokens_seen"], state["elapsed_sec"]
    job.callback_states = with_legacy_states(state)
    log.info("resuming from %s", path)


def train_state(job: Job, step: int, tokens_seen: int, elapsed_sec: float, callbacks: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint holds beside the weights and optimizer; everything is JSON. `callbacks`: the loop
    callbacks' states, by name (the W&B sink's run id among them)."""
    return {
        "step": step,
        "tokens_seen": tokens_seen,
        "elapsed_sec": elapsed_sec,
        "tokens_per_step": job.summary["tokens_per_step"],
        "data": job.data_identity,
        "scheduler": schedule_state(job.scheduler),
        "grad_scaler": job.scaler.state_dict(),
        "rng": every_rank_rng_state(),
        "callbacks": callbacks,
        "guard": job.guard.state_dict(),
        EMA_KEY: job.ema is not None,  # the checkpoint holds the EMA (`load_checkpoint` reads it only then)
        PARAMETRIZATION_KEY: parametrization(job.cfg.model),  # what its weights mean (checkpoint.load_path checks)
    }


def check_global_batch(job: Job, path: Path, state: dict[str, Any]) -> None:
    """A run may resume under another layout, but with the global batch it trained with."""
    tokens_per_step = job.summary["tokens_per_step"]
    # Checkpoints from before tokens_per_step was saved: every step so far had the same number of tokens.
    saved = state.get("tokens_per_step") or state["tokens_seen"] // max(state["step"], 1)
    if saved == tokens_per_step:
        return
    t = job.cfg.train
    per_device = saved / (t.seq_len * t.grad_accum_steps * job.summary["data_parallel"])
    hint = (
        f"set --train.batch_size={int(per_device)} for this layout"
        if per_device.is_integer() and per_device >= 1
        else "choose a layout and train.batch_size × grad_accum_steps that give the same global batch"
    )
    raise UserError(
        f"{path} was trained with {saved} tokens per step, but this layout gives {tokens_per_step} "
        "(train.batch_size × grad_accum_steps × data-parallel ranks × seq_len)",
        hint,
    )


def check_same_data(job: Job, path: Path, state: dict[str, Any]) -> None:
    """A resumed run reads the samples the uninterrupted one would have: the data must be the same shards.
    Every rank checks its own view and they agree, so no rank goes on alone. (Checkpoints from before the
    data was recorded are not checked.)"""
    differs = state.get("data") not in (None, job.data_identity)
    if not any_rank(differs, job.device):
        return
    raise UserError(
        f"{path} was trained on other data than {job.train_data.directory} holds now "
        "(another tokenizer, other shards, or other tokens in them)",
        "point data.dataset_path (or data.hf_dataset_name, with data.hf_dataset_revision for a Hub "
        "dataset) at the data the run trained on, or train into a new --run-dir",
    )
