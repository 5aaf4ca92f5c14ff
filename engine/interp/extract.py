"""`forge extract`: what chosen modules compute over a data set, streamed to disk in one forward per batch.

Forward hooks on every requested module catch their outputs in a single pass; the hook of whichever
requested module runs last raises `StopForward`, so the layers above it (and the output head, unless asked
for) never run. Each batch's rows go straight into the shard being filled (engine/interp/store.py), so
memory holds one batch whatever the data size. Shards are numbered by position in the data, and a shard's
content depends only on the request, so a killed run resumes by skipping the shards already on disk, and
`--nproc-per-node` processes split the shards among themselves and write exactly what one process writes.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from engine.checkpoint.locate import locate_checkpoint
from engine.data.tokenizer import Encoder
from engine.durable import TMP_SUFFIX, check_writable, write_durably
from engine.errors import UserError
from engine.interp.attention import AttentionCapture, attention_targets
from engine.interp.modules import ModuleOutput, first_tensor, probe_outputs, resolve_layers
from engine.interp.routing import RoutingCapture, routing_targets
from engine.interp.store import (
    DTYPES,
    MANIFEST,
    NPZ,
    REQUEST,
    TOKENS,
    TORCH_OF,
    Column,
    ShardFile,
    dumps,
    shard_name,
    write_manifest,
    write_npz,
    write_tokens,
)
from engine.interp.tokens import open_tokens
from engine.model.spec import spec_for
from engine.precision import compute_dtype

STORED_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_SHARD_MB = 256
BACKENDS = "cpu:gloo,cuda:nccl"
JOIN_TIMEOUT_S = 1800.0  # a barrier waits for the slowest rank's shards


@dataclass(frozen=True)
class ExtractRequest:
    """What to extract; everything here but `nproc` decides the bytes written (and is checked on resume)."""

    layers: tuple[str, ...] = ()
    data: str | None = None
    text: str | None = None
    seq_len: int | None = None  # None: the model's max_seq_len
    batch_size: int = 8
    max_tokens: int | None = None
    positions: str = "all"  # "all" or "last"
    dtype: str | None = None  # None: the compute dtype
    step: int | None = None
    storage: str = "shards"  # "shards" or "npz"
    shard_mb: float = DEFAULT_SHARD_MB
    attention: tuple[str, ...] = ()
    heads: tuple[int, ...] = ()  # () = every head
    query_positions: tuple[int, ...] = ()  # () = every position; negative counts from the window's end
    routing: tuple[str, ...] = ()  # MoE blocks whose routing (experts, weights) to store per token


@dataclass
class Progress:
    """Of this process's share of the data (all of it with one process)."""

    tokens_done: int
    tokens_total: int
    bytes_written: int


@dataclass
class Summary:
    out: Path
    layers: list[str]
    rows: int
    tokens: int
    shards_written: int
    shards_skipped: int
    resumed: bool = False
    columns: list[Column] = field(default_factory=list)
    bytes: int = 0


class StopForward(Exception):
    """Raised by the hook of the last requested module: nothing above it needs to run."""


def device_for_extraction() -> torch.device:
    """One GPU per process (by local rank) when there are GPUs, else the CPU."""
    from engine.parallel.launch import device_for
    from engine.parallel.place import process_place

    return device_for(process_place())


def join_if_launched() -> None:
    """A process started by `--nproc-per-node` (or torchrun, srun) joins its group: the processes then split
    the shards and meet at barriers before the manifest is written."""
    from engine.parallel.launch import join_process_group
    from engine.parallel.place import process_place

    if process_place().world_size > 1 and not dist.is_initialized():
        join_process_group(BACKENDS, JOIN_TIMEOUT_S, device_for_extraction())


def checkpoint_path(target: Path, step: int | None) -> Path:
    """The step_N folder to load: `step`'s under the run or checkpoint folder `target`, else `target` itself
    (whose newest complete checkpoint `load_model` picks)."""
    if step is None:
        return target
    root = locate_checkpoint(target).path.parent
    chosen = root / f"step_{step}"
    if not chosen.is_dir():
        have = sorted(p.name for p in root.glob("step_*"))
        raise UserError(f"--step {step}: there is no {chosen}", f"pick one of: {', '.join(have) or 'none saved'}")
    return chosen


def open_model(target: Path, step: int | None, device: torch.device) -> tuple[nn.Module, Encoder, Path]:
    """The model (eval mode, one device, loaded through the same DCP path as generation, which reshards a
    checkpoint saved by any number of processes), its tokenizer, and the checkpoint folder it came from."""
    from engine.checkpoint.hf import is_hf_folder
    from engine.generate import load_model

    path = checkpoint_path(target, step)
    model, encoder = load_model(path, device)
    source = path if is_hf_folder(path) else locate_checkpoint(path).path
    return model, encoder, source


def list_layers(target: Path, step: int | None = None) -> dict[str, ModuleOutput]:
    model, _, _ = open_model(target, step, device_for_extraction())
    return probe_outputs(model)


def config_sha256(model: nn.Module) -> str:
    return hashlib.sha256(model.cfg.model_dump_json().encode()).hexdigest()


@dataclass(frozen=True)
class Plan:
    """Windows cut into batches (a shorter last window alone, so a batch is rectangular) and batches grouped
    into shards of about `shard_mb`. Arithmetic, not lists: its size does not grow with the data."""

    total: int  # tokens
    seq_len: int
    batch_size: int
    per_shard: int  # batches

    @classmethod
    def make(cls, total: int, seq_len: int, batch_size: int, window_bytes: int, shard_bytes: int) -> Plan:
        return cls(total, seq_len, batch_size, max(1, shard_bytes // max(1, window_bytes * batch_size)))

    @property
    def windows(self) -> int:
        return -(-self.total // self.seq_len)

    def window(self, index: int) -> tuple[int, int]:
        """[start, end) of window `index` in the token stream."""
        return index * self.seq_len, min((index + 1) * self.seq_len, self.total)

    @property
    def full_batches(self) -> int:
        return -(-(self.total // self.seq_len) // self.batch_size)

    @property
    def batches(self) -> int:
        return self.full_batches + (self.total % self.seq_len > 0)

    def batch(self, index: int) -> range:
        """The window indices of batch `index`."""
        full = self.total // self.seq_len
        if index < self.full_batches:
            return range(index * self.batch_size, min((index + 1) * self.batch_size, full))
        return range(full, full + 1)

    @property
    def shards(self) -> int:
        return -(-self.batches // self.per_shard)

    def shard(self, index: int) -> range:
        """The batch indices of shard `index`."""
        return range(index * self.per_shard, min((index + 1) * self.per_shard, self.batches))


class Extraction:
    """One extraction: the model with its hooks, the tokens, the plan and the output folder."""

    def __init__(self, target: Path, out: Path, request: ExtractRequest) -> None:
        self.out, self.request = out, request
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.device = device_for_extraction()
        check_request(request)
        self.model, self.encoder, self.checkpoint = open_model(target, request.step, self.device)
        self.compute = compute_dtype("auto", self.device)
        self.stored = STORED_DTYPES[request.dtype] if request.dtype else self.compute
        outputs = probe_outputs(self.model)
        self.parts = spec_for(self.model.cfg).parts
        self.layers = resolve_layers(request.layers, outputs) if request.layers else []
        self.seq_len = request.seq_len or self.model.cfg.max_seq_len
        if self.seq_len > self.model.cfg.max_seq_len:
            raise UserError(
                f"--seq-len {self.seq_len} is longer than the model's context ({self.model.cfg.max_seq_len})",
                f"use --seq-len {self.model.cfg.max_seq_len} or less",
            )
        self.attention = AttentionCapture.make(
            attention_targets(request.attention, outputs, self.parts.attention),
            request.heads,
            request.query_positions,
            self.model.cfg,
            self.seq_len,
        )
        self.routing = RoutingCapture(
            tuple(routing_targets(request.routing, self.model)), self.model.cfg.moe_top_k, self.parts.router
        )
        if not self.layers and not self.attention.blocks and not self.routing.blocks:
            raise UserError(
                "nothing to extract",
                "name modules with --layers, attention with --attention, MoE routing with --routing",
            )
        stored = DTYPES[self.stored]
        routing = self.routing.columns(stored)
        self.columns = [Column(name, outputs[name].shape, stored) for name in self.layers]
        self.columns += self.attention.columns(stored) + routing
        self.token_columns = {*self.layers, *(c.name for c in routing)}  # one row per token (the rest per window)
        self.tokens = open_tokens(self.encoder, request.data, request.text, request.max_tokens)
        per_window = sum(c.row_bytes * (self.seq_len if self.per_token(c) else 1) for c in self.columns)
        self.plan = Plan.make(
            len(self.tokens), self.seq_len, request.batch_size, per_window, int(request.shard_mb * 2**20)
        )

    def per_token(self, column: Column) -> bool:
        return column.name in self.token_columns and self.request.positions == "all"

    def identity(self) -> dict:
        """The request as it decides the output: arguments, checkpoint, model config, data."""
        return {
            "request": asdict(self.request),
            "checkpoint": str(self.checkpoint.resolve()),
            "model_config_sha256": config_sha256(self.model),
            "data": self.tokens.identity,
            "layers": self.layers,
            "seq_len": self.seq_len,
            "dtype": str(self.stored).removeprefix("torch."),
        }

    # --- the output folder ---------------------------------------------------------------------------

    def prepare(self) -> bool:
        """Create or reopen the output folder; True when it already holds this finished extraction. Every rank
        checks the folder before any rank changes it (so all refuse together), then rank 0 writes
        `request.json` and the tokens before any rank writes a shard."""
        wanted = dumps(self.identity())
        barrier()
        self.check_out(wanted)
        barrier()
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            for leftover in self.out.glob(f"*{TMP_SUFFIX}"):
                leftover.unlink()
            if not (self.out / REQUEST).is_file():
                write_durably(self.out / REQUEST, wanted)
            if not (self.out / TOKENS).is_file():
                write_tokens(self.out / TOKENS, self.tokens)
        barrier()
        return (self.out / MANIFEST).is_file()

    def check_out(self, wanted: bytes) -> None:
        check_writable(self.out, "--out", folder=True)
        if self.out.exists() and not (self.out / REQUEST).is_file() and any(self.out.iterdir()):
            raise UserError(
                f"--out {self.out} exists and is not a forge extract output",
                "pass a new folder, or an earlier forge extract output to resume",
            )
        if (self.out / REQUEST).is_file() and (self.out / REQUEST).read_bytes() != wanted:
            raise UserError(
                f"--out {self.out} holds an extraction made with other arguments",
                "rerun with the same arguments to resume it, or pass a new --out folder",
            )

    def run(self, progress: Callable[[Progress], None] | None = None) -> Summary:
        resumed = (self.out / REQUEST).is_file()
        finished = self.prepare()
        summary = Summary(self.out, self.layers, self.rows(), len(self.tokens), 0, 0, resumed, self.columns)
        if finished:
            if self.rank == 0:
                self.remove_joined_shards()  # a run killed after its manifest, while removing them
            summary.shards_skipped = self.plan.shards
            return summary
        mine = range(self.rank, self.plan.shards, self.world)  # shards are dealt out round-robin
        share = sum(self.shard_tokens(self.plan.shard(index)) for index in mine)
        done = 0
        for index in mine:
            batches = self.plan.shard(index)
            path = self.out / shard_name(index)
            tokens = self.shard_tokens(batches)
            if path.is_file() or (self.out / NPZ).is_file():
                summary.shards_skipped += 1
            else:
                self.write_shard(path, batches)
                summary.shards_written += 1
                summary.bytes += path.stat().st_size
            done += tokens
            if progress is not None:
                progress(Progress(done, share, summary.bytes))
        barrier()
        if self.rank == 0:
            self.finish()
        barrier()
        return summary

    def shard_tokens(self, batches: Sequence[int]) -> int:
        wins = [self.plan.window(w) for b in batches for w in self.plan.batch(b)]
        return sum(end - start for start, end in wins)

    def rows(self) -> int:
        if self.request.positions == "last":
            return self.plan.windows
        return len(self.tokens)

    def shard_rows(self, batches: Sequence[int], column: Column) -> int:
        wins = [w for b in batches for w in self.plan.batch(b)]
        if self.per_token(column):
            return sum(self.plan.window(w)[1] - self.plan.window(w)[0] for w in wins)
        return len(wins)

    def write_shard(self, path: Path, batches: Sequence[int]) -> None:
        shard = ShardFile(path, self.columns, {c.name: self.shard_rows(batches, c) for c in self.columns})
        try:
            rows = dict.fromkeys((c.name for c in self.columns), 0)
            for b in batches:
                for name, values in self.forward(self.plan.batch(b)).items():
                    shard.write(name, rows[name], values)
                    rows[name] += len(values)
            shard.commit()
        except BaseException:
            shard.abandon()
            raise

    @torch.no_grad()
    def forward(self, window_ids: Sequence[int]) -> dict[str, torch.Tensor]:
        """One batch through the model up to the last requested module → column name → rows."""
        tokens = torch.from_numpy(np.stack([self.tokens.read(*self.plan.window(w)) for w in window_ids]))
        caught: dict[str, torch.Tensor] = {}
        catchers = self.catchers(len(window_ids), caught)
        wanted = set(catchers)
        modules = dict(self.model.named_modules())

        def hook(name: str) -> Callable:
            def catch(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
                catchers[name](args, kwargs, output)
                wanted.discard(name)
                if not wanted:
                    raise StopForward

            return catch

        handles = [modules[name].register_forward_hook(hook(name), with_kwargs=True) for name in sorted(wanted)]
        try:
            with torch.autocast(self.device.type, dtype=self.compute, enabled=self.compute != torch.float32):
                self.model(tokens.to(self.device))
        except StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
        return {column.name: self.rows_of(column, caught[column.name]) for column in self.columns}

    def catchers(self, batch: int, caught: dict[str, torch.Tensor]) -> dict[str, Callable[[tuple, dict, object], None]]:
        """Module name → what its forward hook keeps (a module may serve several captures)."""
        jobs: dict[str, list[Callable[[tuple, dict, object], None]]] = {}
        for name in self.layers:
            jobs.setdefault(name, []).append(lambda a, kw, out, name=name: caught.__setitem__(name, first_tensor(out)))
        for block in self.attention.blocks:
            jobs.setdefault(f"{block}.{self.parts.attention}", []).append(
                lambda a, kw, out, block=block: self.attention.catch(block, a, kw, caught)
            )
        for name, block in self.routing.modules().items():
            jobs.setdefault(name, []).append(
                lambda a, kw, out, block=block: self.routing.catch(block, out, batch, caught)
            )
        return {name: lambda a, kw, out, fns=fns: [fn(a, kw, out) for fn in fns] for name, fns in jobs.items()}

    def rows_of(self, column: Column, value: torch.Tensor) -> torch.Tensor:
        if column.name in self.token_columns:
            value = value.reshape(-1, *column.shape) if self.per_token(column) else value[:, -1]
        return value.to(TORCH_OF[column.dtype])

    def finish(self) -> None:
        """Rank 0, every shard on disk: the `.npz` when asked, then the manifest (which marks the end)."""
        names = [shard_name(i) for i in range(self.plan.shards)]
        if self.request.storage == "npz" and not (self.out / NPZ).is_file():
            write_npz(self.out, [self.out / n for n in names], self.columns)
        write_manifest(self.out, self.manifest(names))
        self.remove_joined_shards()

    def remove_joined_shards(self) -> None:
        if self.request.storage == "npz":
            for index in range(self.plan.shards):
                (self.out / shard_name(index)).unlink(missing_ok=True)

    def manifest(self, shards: list[str]) -> dict:
        return {
            "checkpoint": str(self.checkpoint.resolve()),
            "step": step_of(self.checkpoint),
            "model_config_sha256": config_sha256(self.model),
            "model_config": json.loads(self.model.cfg.model_dump_json()),
            "tokenizer_sha256": self.encoder.sha256,
            "eos_id": self.encoder.eos_id,
            "layers": self.layers,
            "attention": self.attention.describe(),
            "routing": list(self.routing.blocks),
            "columns": [{"name": c.name, "shape": list(c.shape), "dtype": c.dtype} for c in self.columns],
            "rows": {"positions": self.request.positions, "seq_len": self.seq_len, "windows": self.plan.windows},
            "tokens": {"file": TOKENS, "count": len(self.tokens)},
            "storage": self.request.storage,
            "shards": shards if self.request.storage == "shards" else [],
            "npz": NPZ if self.request.storage == "npz" else None,
            "request": self.identity(),
        }


def step_of(checkpoint: Path) -> int | None:
    name = checkpoint.name
    return int(name.removeprefix("step_")) if name.startswith("step_") and name[5:].isdigit() else None


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def check_request(request: ExtractRequest) -> None:
    """The options that can be judged without the model."""
    if request.positions not in ("all", "last"):
        raise UserError(f"--positions {request.positions!r} is not one of all, last", "use --positions all or last")
    if request.dtype is not None and request.dtype not in STORED_DTYPES:
        raise UserError(f"--dtype {request.dtype!r} is not one of {', '.join(STORED_DTYPES)}", "e.g. --dtype bf16")
    if request.storage not in ("shards", "npz"):
        raise UserError(f"--format {request.storage!r} is not one of shards, npz", "e.g. --format npz")
    if request.batch_size < 1:
        raise UserError(f"--batch-size {request.batch_size} must be at least 1", "e.g. --batch-size 8")
    if not (math.isfinite(request.shard_mb) and request.shard_mb > 0):  # NaN and inf have no byte count
        raise UserError(
            f"--shard-mb {request.shard_mb} must be a positive, finite size", f"e.g. --shard-mb {DEFAULT_SHARD_MB}"
        )
    if request.seq_len is not None and request.seq_len < 1:
        raise UserError(f"--seq-len {request.seq_len} must be at least 1", "leave it out to use the model's context")


def extract(
    target: Path, out: Path, request: ExtractRequest, progress: Callable[[Progress], None] | None = None
) -> Summary:
    """Run (or resume) an extraction of `target` (run directory, checkpoint folder, step_N, or Hugging Face
    folder) into `out`. Every check happens before anything is written."""
    return Extraction(target, out, request).run(progress)
