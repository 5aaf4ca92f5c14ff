"""One run's checkpoints: when to save, synchronously or in the background, what to keep, and what a
run starts from (its own newest readable checkpoint, else `checkpoint.load_path`)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import shutil
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.checkpoint.dcp import (
    COMPLETE,
    PARAMETRIZATION_KEY,
    TRAIN_STATE,
    UNREADABLE,
    Extra,
    complete_checkpoints,
    describe,
    finish_save,
    is_writer,
    latest_checkpoint,
    load_checkpoint,
    load_weights,
    new_step_dir,
    parametrization,
    prune_checkpoints,
    save_checkpoint,
    start_async_save,
    training_state,
    underlying,
)
from engine.checkpoint.hf import is_hf_folder, load_hf_weights
from engine.checkpoint.layout import STEP_DIR
from engine.config.checkpoint import CheckpointConfig
from engine.errors import UserError
from engine.resilience.collectives import any_rank, distributed, every_rank

log = logging.getLogger("forge.checkpoint")


@dataclass
class PendingSave:
    step: int
    path: Path
    train_state: dict[str, Any]
    staging: Future | None
    upload: Future  # done once the files are written and this rank's checksums recorded
    model: nn.Module  # for the size a checkpoint needs, if the disk is full
    optimizer: torch.optim.Optimizer


class Checkpointer:
    clock = staticmethod(time.monotonic)  # what `interval_minutes` is measured with; tests replace it

    def __init__(
        self,
        root: Path,
        cfg: CheckpointConfig,
        device: torch.device,
        extra: Mapping[str, Extra] | None = None,
        trainable_only: bool = False,
    ) -> None:
        self.root, self.cfg, self.device = root, cfg, device
        self.trainable_only = trainable_only  # lora.save_adapters_only: the frozen base is not saved
        self.extra = dict(extra or {})  # saved and restored beside model and optimizer (e.g. "ema")
        self.last_save = self.clock()
        self.pending: PendingSave | None = None
        self.pin_memory = cfg.async_mode == "async_with_pinned_mem" and device.type == "cuda"
        self.group = self.control = None
        if cfg.async_mode != "disabled" and distributed():
            # DCP's background save runs collectives from another thread; on the training group they would
            # interleave with the training step's and gloo aborts on the mismatch. Its own gloo group is safe.
            self.group = torch.distributed.new_group(backend="gloo")
            # `poll` asks every rank whether its upload is done, from the training thread: neither the
            # training group (a device sync each step) nor the upload's group (busy in another thread).
            self.control = torch.distributed.new_group(backend="gloo")

    def due(self, step: int, max_steps: int) -> bool:
        """Whether to save after step `step`: the last step, every `interval` steps, or `interval_minutes`
        since the last save. Collective when interval_minutes is set: ranks' clocks differ, and a save
        starts on every rank as soon as one of them says it is time, so all save at the same step."""
        timed = self.cfg.interval_minutes is not None and any_rank(
            self.clock() - self.last_save >= 60 * self.cfg.interval_minutes, self.device
        )
        return timed or step == max_steps or bool(self.cfg.interval and step % self.cfg.interval == 0)

    def save(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict[str, Any]
    ) -> Path | None:
        """Save step `step`. Synchronous: returns the complete checkpoint. Asynchronous: returns None at
        once; `poll` or `wait` later finish it. One save at a time: a new one first finishes the last."""
        self.wait()
        self.last_save = self.clock()
        if self.cfg.async_mode == "disabled":
            with write_errors(step, self.root, model, optimizer, self.extra):
                path = save_checkpoint(self.root, step, model, optimizer, train_state, self.extra, self.trainable_only)
            self.prune(step)
            return path
        path = new_step_dir(self.root, step)
        with write_errors(step, self.root, model, optimizer, self.extra):
            staging, upload = start_async_save(
                path,
                training_state(model, optimizer, self.extra, self.trainable_only),
                stage_in_background=self.cfg.async_mode == "async_with_pinned_mem",
                pin_memory=self.pin_memory,
                process_group=self.group,
            )
        self.pending = PendingSave(step, path, train_state, staging, upload, model, optimizer)
        return None

    def wait_for_staging(self) -> None:
        """Block until a background save holds its own copy of the state: call before changing weights."""
        if self.pending is not None and self.pending.staging is not None:
            self.pending.staging.result()
            self.pending.staging = None

    def poll(self) -> tuple[int, Path] | None:
        """Finish a background save whose files are written on every rank; (step, path) when one completed.
        Ranks decide together: one that finished alone would wait in `wait`'s barrier while the others
        run the next step's collectives, and the run would hang."""
        if self.pending is None:
            return None
        if every_rank(self.pending.upload.done(), torch.device("cpu"), self.control):
            return self.wait()
        return None

    def wait(self) -> tuple[int, Path] | None:
        """Finish the background save in flight, if any (blocking); (step, path) of what completed."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        with write_errors(
            pending.step, self.root, pending.model, pending.optimizer, self.extra
        ):  # a failed write raises here
            if pending.staging is not None:
                pending.staging.result()
            pending.upload.result()
        if distributed():
            torch.distributed.barrier()  # every rank's checksums are on disk before rank 0 gathers them
        if is_writer():
            finish_save(self.root, pending.path, pending.train_state)
        if distributed():
            torch.distributed.barrier()  # every rank sees COMPLETE before it may look for checkpoints
        self.prune(pending.step)
        return pending.step, pending.path

    def prune(self, saved_step: int) -> None:
        if is_writer():
            prune_checkpoints(self.root, self.cfg.keep_last_n, saved_step, self.cfg.kept)

    def has(self, step: int) -> bool:
        return (self.root / f"step_{step}" / COMPLETE).is_file() or (
            self.pending is not None and self.pending.step == step
        )

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Path, dict[str, Any]] | None:
        """Load the newest complete checkpoint that reads back whole; fall back to older ones past any that
        is damaged (truncated shard, lost metadata). None when there is none; an error when every one is
        damaged. Nothing is ever deleted here."""
        latest_checkpoint(self.root)  # warns about an interrupted newest save
        failures = []
        for _step, path in reversed(complete_checkpoints(self.root)):
            try:
                return path, load_checkpoint(path, model, optimizer, self.extra, self.trainable_only)
            except UNREADABLE as err:  # any damage: a missing file, a short read, bad JSON, bad pickle
                log.warning("checkpoint %s cannot be read (%s); trying the one before it", path, describe(err))
                failures.append(f"{path.name}: {describe(err)}")
        if failures:
            raise UserError(
                f"no readable checkpoint in {self.root}: " + "; ".join(failures),
                "restore the checkpoint files, or train into a new --run-dir (nothing was deleted)",
            )
        return None

    def rollback(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Path, dict[str, Any]] | None:
        """Reload weights and optimizer state from the newest readable checkpoint; (path, its train state),
        or None if there is none."""
        self.wait()
        return self.restore(model, optimizer)


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed (disk full, permissions, a lost file system)."""


@contextlib.contextmanager
def write_errors(
    step: int, root: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: Mapping[str, Extra]
) -> Iterator[None]:
    """A failed write becomes one CheckpointWriteError; its partial folder is removed (it would only fill
    the disk: it has no COMPLETE and is never loaded). A full disk says how much space a checkpoint needs."""
    try:
        yield
    except UNREADABLE as err:
        folder = root / f"step_{step}"
        if is_writer() and not (folder / COMPLETE).is_file():  # a failure after COMPLETE (a barrier) keeps it
            shutil.rmtree(folder, ignore_errors=True)
        message = f"writing the checkpoint of step {step} failed: {describe(err)}"
        needed, free = state_bytes(model, optimizer, extra), shutil.disk_usage(root).free
        if out_of_space(err) or free < needed:
            message = (
                f"the disk is full: the checkpoint of step {step} needs about {gib(needed)} "
                f"and {root} has {gib(free)} free; its partial folder was removed, the checkpoints before it "
                "are intact. Free space (or lower checkpoint.keep_last_n) and resume"
            )
        raise CheckpointWriteError(message) from err


def out_of_space(err: BaseException | None) -> bool:
    """ENOSPC anywhere in the error or what it was raised from: torch's zip writer turns the OSError of a
    full disk into a RuntimeError of its own ("unexpected pos"), which then surfaces first."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        err = underlying(err)
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
        err = err.__cause__ or err.__context__
    return False


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, extra: Mapping[str, Extra]) -> int:
    """Bytes of the weights, optimizer state and extra state (the EMA) of the whole model, what one checkpoint
    holds (a sharded tensor's numel is its global one; a replicated tensor is written once)."""
    tensors = list(model.state_dict().values()) + [t for entry in extra.values() for t in entry.state_dict().values()]
    tensors += [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    return sum(t.numel() * t.element_size() for t in tensors)


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**27 else f"{size / 2**20:.1f} MiB"


def resolve_load_path(path: Path) -> Path:
    """A step_N folder, a checkpoint folder (its newest complete checkpoint) or a run directory."""
    if not path.exists():
        raise UserError(
            f"checkpoint.load_path {path} does not exist", "point it at a step_N folder or a checkpoint folder"
        )
    if (path / COMPLETE).is_file():
        return path
    if STEP_DIR.match(path.name) and path.is_dir():
        raise UserError(
            f"checkpoint.load_path {path} is an incomplete checkpoint (its save was interrupted)",
            "use an older step_N folder, or the checkpoint folder to take its newest complete one",
        )
    for root in (path, path / "checkpoints"):
        newest = latest_checkpoint(root)
        if newest is not None:
            return newest[1]
    raise UserError(
        f"checkpoint.load_path {path} holds no complete checkpoint",
        "point it at a step_N folder (with COMPLETE and train_state.json) or its parent folder",
    )


def check_same_parametrization(source: Path, cfg: Any) -> None:
    """A Forge checkpoint's weights mean what its parametrization says: μP stores weights that its forward
    scales (engine/model/mup.py), against a base width. Loading them into a model of another parametrization
    or base width would fit by shape and compute another function, so that is refused. Checkpoints written
    before train_state.json recorded it pass unchecked."""
    state = source / TRAIN_STATE
    theirs = json.loads(state.read_text()).get(PARAMETRIZATION_KEY) if state.is_file() else None
    ours = parametrization(cfg)
    if theirs is not None and theirs != ours:
        raise UserError(
            f"checkpoint.load_path {source} holds weights of parametrization {theirs!r}, and this run's model is "
            f"{ours!r} (model.parametrization, model.mup_base_dim): the same shapes, another function",
            "load a checkpoint trained with this run's model.parametrization and mup_base_dim, or set them to "
            "the checkpoint's",
        )


def initialize_from(path: Path, model: nn.Module, exclude: list[str]) -> list[str]:
    """Start a new run from another run's weights (not its optimizer, schedule or step), or from a
    Hugging Face model folder."""
    from_hf = is_hf_folder(path)
    source = path if from_hf else resolve_load_path(path)
    names = {name for name, _ in model.named_parameters()}
    unknown = [prefix for prefix in exclude if not any(name.startswith(prefix) for name in names)]
    if unknown:
        raise UserError(
            f"checkpoint.exclude_from_loading has prefixes that match no parameter: {', '.join(unknown)}",
            "use parameter-name prefixes such as 'output.' or 'layers.3.'",
        )
    if not from_hf:
        check_same_parametrization(source, model.cfg)
    try:
        loaded = load_hf_weights(model, source, exclude) if from_hf else load_weights(source, model, exclude)
    except UserError:
        raise
    except UNREADABLE as err:
        raise UserError(
            f"checkpoint.load_path {source} does not fit this model: {describe(err)}",
            "load a checkpoint of the same shape, or list the differing parameters in checkpoint.exclude_from_loading",
        ) from None
    log.info("initialised %d tensors from %s (excluded: %s)", len(loaded), source, exclude or "none")
    return loaded
