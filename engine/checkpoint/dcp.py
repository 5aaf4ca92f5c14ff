"""Save and load training state with torch.distributed.checkpoint (DCP).

Layout under the checkpoint folder:

    step_N/            one checkpoint: DCP shard files + .metadata (model and optimizer, through
                       `get_state_dict`, so the same code serves sharded models), train_state.json
                       (step, tokens seen, LR scheduler, RNG states; JSON, never pickle), checksums.json
                       (a CRC-32 of every other file, engine/checkpoint/verify.py; checked on load), and
                       COMPLETE, written last, after every other file is on disk (fsync)
    latest             the name of the newest complete checkpoint, replaced atomically after COMPLETE
                       (for people and tools; Forge itself resumes from the newest folder with COMPLETE,
                       which is the same one unless `latest` was lost)
    step_N.superseded-K  a complete step_N that a later save of the same step found in its way (never
                       deleted for it: `new_step_dir`); nothing loads or prunes it

A folder without COMPLETE was cut short (the job was killed while saving) and is never loaded. DCP can
load a checkpoint into a different parallel layout than the one that saved it.

Loading never unpickles arbitrary objects: DCP's `.metadata` is a pickle, so it is read with an
unpickler that only builds DCP's own metadata classes; tensors and the non-tensor values DCP stores as
bytes (optimizer hyperparameters) are read with `weights_only=True`, and the train state is JSON.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import logging
import pickle
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from engine.checkpoint.layout import COMPLETE, complete_checkpoints, step_dirs
from engine.checkpoint.verify import merge_checksums, record_rank_checksums, verify_checkpoint
from engine.durable import fsync_dir, fsync_file, write_durably
from engine.resilience.collectives import distributed
from engine.safe_paths import file_in

TRAIN_STATE = "train_state.json"
LATEST = "latest"
# train_state.json's record of what the weights mean: μP's stored weights are not a standard model's
# (engine/model/mup.py: multipliers applied in forward, scaled init), so checkpoint.load_path compares it.
PARAMETRIZATION_KEY = "parametrization"


def parametrization(cfg: Any) -> str:
    """The model section's parametrization as train_state.json records it: "sp", or "mup@BASE_DIM"."""
    return "sp" if cfg.parametrization == "sp" else f"mup@{cfg.mup_base_dim}"


log = logging.getLogger("forge.checkpoint")
# A background save warns from its own thread, out of reach of `single_process_quiet`.
warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning, "torch.distributed.checkpoint")

# What reading a damaged or mismatched checkpoint raises; DCP wraps per-rank failures in CheckpointException,
# which derives from BaseException.
UNREADABLE = (Exception, CheckpointException)


class Extra(Protocol):
    """State saved beside the model and optimizer: its tensors, which a load fills in place."""

    def state_dict(self) -> dict[str, torch.Tensor]: ...


def underlying(err: BaseException) -> BaseException:
    """For DCP's wrapped per-rank failures, the first failing rank's own error; else `err`."""
    if isinstance(err, CheckpointException) and err.failures:
        failure = next(iter(err.failures.values()))  # (exception, traceback) of the first failing rank
        return failure[0] if isinstance(failure, tuple) else failure
    return err


# DCP writes a checkpoint's files from extra threads too (WRITE_THREADS). An error in one (a full disk) goes to
# the thread's excepthook, which prints a traceback per thread, and the save itself need not learn about it
# (the thread's files would just be missing). The hook below keeps such errors for `raise_writer_failure`.
WRITER_THREAD = "(_write_files_from_queue)"
writer_failures: list[BaseException] = []


def keep_writer_thread_errors(args: Any, previous: Callable[[Any], None] = threading.excepthook) -> None:
    if args.thread is not None and args.thread.name.endswith(WRITER_THREAD) and args.exc_value is not None:
        writer_failures.append(args.exc_value)
        return
    previous(args)


threading.excepthook = keep_writer_thread_errors


def raise_writer_failure() -> None:
    """Raise the first error of a DCP writer thread since the last call, if there was one."""
    failures = writer_failures.copy()
    writer_failures.clear()
    if failures:
        raise failures[0]


def describe(err: BaseException) -> str:
    """One line about a load failure; for DCP's wrapped per-rank failures, the underlying error."""
    err = underlying(err)
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns whenever one process saves or loads alone, which is exactly what we ask for without a group."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint; newer incomplete ones (a save that was killed) are skipped with a warning."""
    complete = complete_checkpoints(root)
    newest = complete[-1] if complete else None
    for step, path in step_dirs(root):
        if newest is None or step > newest[0]:
            log.warning("skipping incomplete checkpoint %s (its save was interrupted)", path)
    return newest


# --- saving ---------------------------------------------------------------------------------------------


def rank() -> int:
    return torch.distributed.get_rank() if distributed() else 0


def is_writer() -> bool:
    """The one process that creates folders and writes markers; every rank writes its own DCP shards."""
    return not distributed() or torch.distributed.get_rank() == 0


def new_step_dir(root: Path, step: int) -> Path:
    """The empty folder a save of `step` writes into. A folder of that name left by a save cut short (no
    COMPLETE) is removed; a complete one (a damaged checkpoint the run fell back from, or one this run did
    not write) is never deleted to make room: it is set aside under another name, and a warning says where."""
    writer_failures.clear()  # left by a save that failed with an error of its own
    path = root / f"step_{step}"
    if is_writer():
        if (path / COMPLETE).is_file():
            kept = set_aside(path)
            log.warning("%s was a complete checkpoint: kept as %s (delete it once it is not needed)", path, kept)
        elif path.exists():  # a save of this step that was cut short by a kill
            shutil.rmtree(path)
        path.mkdir(parents=True)
    if distributed():
        torch.distributed.barrier()
    return path


def set_aside(path: Path) -> Path:
    """Rename `path` to the first free `NAME.superseded-K`, a name no step_N lookup, load or prune matches."""
    for k in itertools.count(1):
        target = path.with_name(f"{path.name}.superseded-{k}")
        if not target.exists():
            path.rename(target)
            return target
    raise AssertionError("unreachable")


# Threads each process writes its checkpoint files with. DCP's default of one leaves the disk idle while
# it serialises: on a 2-core VM, 1.5 GiB took 2.0 s with one thread, 1.2-1.5 s with two, 0.9-1.0 s with
# four (benchmarks/results/checkpoint_cpu.md).
WRITE_THREADS = 4


def storage_writer(path: Path) -> FileSystemWriter:
    return FileSystemWriter(path, thread_count=WRITE_THREADS)


def model_options(trainable_only: bool) -> StateDictOptions:
    """What of the model a checkpoint holds: every tensor, or (`trainable_only`, LoRA's save_adapters_only)
    only those that train, the frozen base being rebuilt from where it came from; loading such a checkpoint
    fills those and leaves the rest as they are."""
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: Mapping[str, Extra] = MappingProxyType({}),
    trainable_only: bool = False,
) -> dict[str, Any]:
    """Model and optimizer, plus `extra` entries (e.g. "ema": the EMA of the weights), each saved under its
    name from its `state_dict()`; `trainable_only`: see `model_options`."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=model_options(trainable_only))
    return {"model": model_sd, "optimizer": optim_sd, **{name: entry.state_dict() for name, entry in extra.items()}}


def finish_save(root: Path, path: Path, train_state: dict[str, Any]) -> Path:
    """After DCP has written its files and every rank has recorded their checksums: the train state, the
    checksums, fsync, COMPLETE, then `latest`, in that order."""
    (path / TRAIN_STATE).write_text(json.dumps(train_state))
    merge_checksums(path, [TRAIN_STATE])
    for file in path.iterdir():
        fsync_file(file)
    fsync_dir(path)  # the shards' directory entries before COMPLETE's
    write_durably(path / COMPLETE, "")
    write_durably(root / LATEST, path.name)
    return path


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    extra: Mapping[str, Extra] = MappingProxyType({}),
    trainable_only: bool = False,
) -> Path:
    """Write step_N durably and mark it complete, blocking until it is on disk."""
    path = new_step_dir(root, step)
    with single_process_quiet():
        dcp.save(
            training_state(model, optimizer, extra, trainable_only),
            storage_writer=storage_writer(path),
            no_dist=not distributed(),
        )
    raise_writer_failure()
    record_rank_checksums(path, rank())
    if distributed():
        torch.distributed.barrier()  # every rank's checksums are on disk before rank 0 gathers them
    if is_writer():
        finish_save(root, path, train_state)
    if distributed():
        torch.distributed.barrier()  # every rank sees COMPLETE before it may look for checkpoints
    return path


def start_async_save(
    path: Path, state: dict[str, Any], *, stage_in_background: bool, pin_memory: bool, process_group: Any = None
) -> tuple[Future | None, Future]:
    """Begin writing `state` in a background thread. Returns (staging, upload) futures: the weights and
    optimizer may change only once staging is done (None: it already is); the files are written when
    upload is done."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    options = StagingOptions(
        use_pinned_memory=pin_memory,
        use_shared_memory=False,
        use_async_staging=stage_in_background,
        use_non_blocking_copy=pin_memory,
    )
    with single_process_quiet():
        response = dcp.async_save(
            state,
            storage_writer=storage_writer(path),
            process_group=process_group,
            async_stager=DefaultStager(options),
            no_dist=not distributed(),
        )
    if isinstance(response, Future):
        return None, then_record_checksums(response, path)
    return response.staging_completion, then_record_checksums(response.upload_completion, path)


def then_record_checksums(upload: Future, path: Path) -> Future:
    """A future done once `upload` is and this rank's checksums are recorded, in a thread of its own: the
    files are read back after they are written, never in the training loop."""
    done: Future = Future()
    own_rank = rank()

    def record(finished: Future) -> None:
        try:
            finished.result()
            raise_writer_failure()
            record_rank_checksums(path, own_rank)
        except BaseException as err:  # the write's own failure (a full disk) reaches whoever waits on `done`
            done.set_exception(err)
        else:
            done.set_result(None)

    upload.add_done_callback(lambda finished: threading.Thread(target=record, args=(finished,), daemon=True).start())
    return done


# --- loading --------------------------------------------------------------------------------------------


class MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP's `.metadata` holds; anything else in the pickle is refused, not run. Names
    are matched exactly (no dotted paths, which pickle would otherwise follow into a module's imports)."""

    ALLOWED = {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    } | {
        ("torch", "Size"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and "." not in name and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which it never should")


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that non-tensor values (e.g. the optimizer's lr and betas, stored as
    torch.save bytes) are read with `weights_only=True`: plain numbers and containers, never objects."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata read through `MetadataUnpickler`, and every file the metadata names
    a regular file's plain name inside the checkpoint folder (`engine.safe_paths.file_in`): DCP would open
    whatever path it names, `../` or /dev/zero included."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with open(Path(self.path) / name, "rb") as file:
            metadata = MetadataUnpickler(file).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{name} does not hold DCP metadata")
        for info in (metadata.storage_data or {}).values():
            file_in(Path(self.path), getattr(info, "relative_path", None), Path(self.path) / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_state(path: Path, state: dict[str, Any], *, local: bool = False) -> None:
    """Fill `state` from the checkpoint at `path`; `local`: this process alone reads (whole tensors), even
    in a multi-process run, where DCP would otherwise plan the read with every rank."""
    if not (path / ".metadata").is_file():  # else DCP logs two tracebacks while it looks for per-rank metadata
        raise FileNotFoundError(f"{path / '.metadata'} is missing")
    with single_process_quiet():
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(path),
            planner=WeightsOnlyLoadPlanner(),
            no_dist=local or not distributed(),
        )


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Extra] = MappingProxyType({}),
    trainable_only: bool = False,
) -> dict[str, Any]:
    """Load the model (and the optimizer, when given) in place; return the saved train state. Each `extra`
    entry is filled in place where the train state says the checkpoint holds it (`train_state[name]` true),
    so checkpoints saved without it still load. `trainable_only`: see `model_options`."""
    optimizers = [optimizer] if optimizer is not None else []
    options = model_options(trainable_only)
    model_sd, optim_sd = get_state_dict(model, optimizers, options=options)
    state = {"model": model_sd, **({"optimizer": optim_sd} if optimizers else {})}
    train_state = json.loads((path / TRAIN_STATE).read_text())  # first: a cheap check that the folder is whole
    verify_checkpoint(path)  # bytes damaged on disk: DCP would load them without a word
    state |= {name: entry.state_dict() for name, entry in extra.items() if train_state.get(name)}
    read_state(path, state)
    set_state_dict(
        model,
        optimizers,
        model_state_dict=state["model"],
        optim_state_dict=state.get("optimizer", {}),
        options=options,
    )
    return train_state


def load_weights(path: Path, model: nn.Module, exclude: list[str] = ()) -> list[str]:
    """Load only the weights of a whole (unsharded) model from a checkpoint of any layout, except names
    under `exclude` (which keep their fresh initialisation); this process alone reads. Returns the names
    that were loaded."""
    model_sd = get_model_state_dict(model)
    wanted = {name: value for name, value in model_sd.items() if not name.startswith(tuple(exclude))}
    names = sorted(wanted)  # now: set_model_state_dict may add entries to the dict it is given
    state = {"model": wanted}
    read_state(path, state, local=True)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    return names


def prune_checkpoints(
    root: Path, keep_last_n: int | None, saved_step: int, kept: Callable[[int], bool] = lambda step: False
) -> None:
    """After saving `saved_step`: delete all but the newest `keep_last_n` complete checkpoints up to it,
    except those `kept` marks as permanent, and incomplete folders older than it. Folders of later steps
    are left alone: they belong to an attempt this run resumed past (say, a damaged checkpoint it fell
    back from), and a checkpoint is never judged by its step number alone. COMPLETE goes first (and
    reaches the disk) before any other file, so a deletion cut short, even by SIGKILL, never leaves a
    loadable half, and the next prune finishes it."""
    if keep_last_n is None:
        return
    complete = [(step, path) for step, path in complete_checkpoints(root) if step <= saved_step]
    keep = {path for _, path in complete[-keep_last_n:]} | {path for step, path in complete if kept(step)}
    for step, path in step_dirs(root):
        if path not in keep and step < saved_step:
            (path / COMPLETE).unlink(missing_ok=True)
            fsync_dir(path)
            shutil.rmtree(path)
