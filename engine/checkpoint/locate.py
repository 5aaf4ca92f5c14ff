"""From what a user points at (a run directory, a checkpoint folder, one step_N folder) to one complete
checkpoint, the model config it was saved with, and the tokenizer that goes with it.

Where the model config comes from:
  - a run directory's `config.toml` (what `forge train` writes), for its own checkpoint folder;
  - `model.toml` in a checkpoint folder written by `forge convert from-hf`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.checkpoint.dcp import COMPLETE, TRAIN_STATE, SafeFileSystemReader, latest_checkpoint, read_state, step_dirs
from engine.checkpoint.layout import STEP_DIR, checkpoint_root
from engine.config.job import JobConfig
from engine.config.loader import load_job_config
from engine.config.lora import LoraConfig
from engine.config.model import ModelConfig
from engine.errors import UserError
from engine.run_files import RUN_CONFIG

MODEL_CONFIG = "model.toml"  # the [model] section beside a checkpoint folder that has no run directory
TOKENIZER = "tokenizer.json"
EMA_KEY = "ema"  # the checkpoint entry and train-state flag of the EMA (engine.train.ema.STATE_KEY)


@dataclass(frozen=True)
class ForgeCheckpoint:
    path: Path  # the step_N folder
    model: ModelConfig
    tokenizer: Path | None  # a tokenizer.json, when the run had one
    averaging_beta1: float | None = None  # schedule-free AdamW's β1: the model to use is its average x
    ema: bool = False  # use the EMA of the weights the run kept (train.ema_decay) instead of its weights
    lora: LoraConfig | None = None  # the run trained LoRA adapters (engine/model/lora.py) on a frozen base
    base_path: str | None = None  # its checkpoint.load_path: where an adapters-only checkpoint's base is
    export_dtype: str = "float32"  # its checkpoint.export_dtype: what `forge convert to-hf` writes without --dtype


def run_checkpoint(step: Path, cfg: JobConfig, run_dir: Path) -> ForgeCheckpoint:
    schedule_free = cfg.optimizer.name == "schedule_free_adamw"
    return ForgeCheckpoint(
        step,
        cfg.model,
        tokenizer_in(run_dir),
        cfg.optimizer.betas[0] if schedule_free else None,
        lora=cfg.lora if cfg.lora.enabled else None,
        base_path=cfg.checkpoint.load_path,
        export_dtype=cfg.checkpoint.export_dtype,
    )


def averaged(ckpt: ForgeCheckpoint, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights to evaluate and ship. Schedule-free AdamW trains at y, saved as the model's weights, while
    what it has learnt is the average x = (y - (1 - β1)·z) / β1, with z from the saved optimizer state
    (the formula of the optimizer's eval mode). Asked for the EMA (`ckpt.ema`): the saved EMA of every
    parameter (buffers keep their saved values). Otherwise `tensors` as they are. In place."""
    if ckpt.ema:
        averages = saved_averages(ckpt)
        read_state(ckpt.path, {EMA_KEY: {name: value for name, value in tensors.items() if name in averages}})
        return tensors
    beta1 = ckpt.averaging_beta1
    if beta1 is None:
        return tensors
    z = {name: torch.empty_like(value) for name, value in tensors.items()}
    read_state(ckpt.path, {"optimizer": {"state": {name: {"z": value} for name, value in z.items()}}})
    for name, value in tensors.items():
        value.lerp_(z[name].to(value.dtype), 1 - 1 / beta1)
    return tensors


def saved_averages(ckpt: ForgeCheckpoint) -> set[str]:
    """The parameter names the checkpoint holds an EMA of (from its metadata, no tensor read)."""
    metadata = SafeFileSystemReader(ckpt.path).read_metadata().state_dict_metadata
    return {key.removeprefix(f"{EMA_KEY}.") for key in metadata if key.startswith(f"{EMA_KEY}.")}


def find_checkpoint(target: Path, ema: bool = False) -> ForgeCheckpoint:
    """Resolve a run directory, a checkpoint folder or a step_N folder; a UserError says what is wrong.
    `ema`: its EMA of the weights is what to use; an error when it holds none."""
    ckpt = locate_checkpoint(target)
    if not ema:
        return ckpt
    if not json.loads((ckpt.path / TRAIN_STATE).read_text()).get(EMA_KEY):
        raise UserError(
            f"checkpoint {ckpt.path} holds no EMA of the weights (its run had train.ema_decay = 0)",
            "leave out --ema, or train with train.ema_decay set (e.g. 0.999)",
        )
    return replace(ckpt, ema=True, averaging_beta1=None)


def locate_checkpoint(target: Path) -> ForgeCheckpoint:
    """The checkpoint `target` names, with its model config and tokenizer."""
    if not target.exists():
        raise UserError(
            f"{target} does not exist", "pass a run directory (forge train --run-dir) or a checkpoint folder"
        )
    if not target.is_dir():
        raise UserError(
            f"{target} is a file, not a run directory or checkpoint folder",
            "pass the folder forge train wrote, e.g. runs/debug",
        )
    if (target / RUN_CONFIG).is_file():
        cfg = load_job_config(target / RUN_CONFIG)
        step = newest_complete(checkpoint_root(target, cfg.checkpoint.dir), f"run {target}")
        return run_checkpoint(step, cfg, target)
    if STEP_DIR.match(target.name):
        if not (target / COMPLETE).is_file():
            raise UserError(
                f"checkpoint {target} is incomplete (its save was interrupted)",
                "use an older step_N folder, or the checkpoint folder to pick the newest complete one",
            )
        return with_config(target, target.parent)
    if step_dirs(target) or (target / MODEL_CONFIG).is_file():
        return with_config(newest_complete(target, f"checkpoint folder {target}"), target)
    if (target / "config.json").is_file():
        raise UserError(
            f"{target} is a Hugging Face model folder, not a Forge checkpoint",
            "convert it first: forge convert from-hf HF_DIR --out CKPT",
        )
    raise UserError(
        f"{target} is not a Forge run directory or checkpoint folder (no {RUN_CONFIG}, no step_N folders)",
        "pass the folder forge train wrote (e.g. runs/debug), its checkpoints/ folder, or one step_N in it",
    )


def step_folders(target: Path) -> list[Path]:
    """Every step_N folder, complete or not, of a run directory, a checkpoint folder, or just `target` if it
    is one (for `forge checkpoint verify`)."""
    if not target.is_dir():
        raise UserError(f"{target} is not a folder", "pass a run directory, its checkpoint folder or a step_N folder")
    if STEP_DIR.match(target.name):
        return [target]
    if (target / RUN_CONFIG).is_file():
        root = checkpoint_root(target, load_job_config(target / RUN_CONFIG).checkpoint.dir)
    else:
        root = target
    folders = [path for _, path in step_dirs(root)]
    if not folders:
        raise UserError(f"{target} holds no checkpoint (no step_N folder in {root})", "pass a run directory")
    return folders


def newest_complete(root: Path, what: str) -> Path:
    newest = latest_checkpoint(root)
    if newest is None:
        raise UserError(
            f"{what} has no complete checkpoint in {root}",
            "train until a checkpoint is saved (checkpoint.interval, or the end of the run)",
        )
    return newest[1]


def with_config(step: Path, root: Path) -> ForgeCheckpoint:
    """The model config of a checkpoint folder: its own model.toml, else the nearest run directory above
    it whose config names this folder as its checkpoint folder."""
    if (root / MODEL_CONFIG).is_file():
        return ForgeCheckpoint(step, load_job_config(root / MODEL_CONFIG).model, tokenizer_in(root))
    run_dir = next((p for p in root.parents if (p / RUN_CONFIG).is_file()), None)
    if run_dir is not None:
        cfg = load_job_config(run_dir / RUN_CONFIG)
        if (run_dir / cfg.checkpoint.dir).resolve() == root.resolve():  # only compared: nothing is read there
            return run_checkpoint(step, cfg, run_dir)
    raise UserError(
        f"cannot find the model config of checkpoint {step} (no {MODEL_CONFIG} in {root} and no run "
        f"directory above it whose {RUN_CONFIG} saves checkpoints there)",
        "pass the run directory instead",
    )


def tokenizer_in(folder: Path) -> Path | None:
    path = folder / TOKENIZER
    return path if path.is_file() else None


def merged(ckpt: ForgeCheckpoint, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """For a LoRA run: each base weight in `tensors` that has an adapter in the checkpoint plus its
    (alpha / r)·B·A, in fp32 then back to the weight's dtype, i.e. the weights the trained model computes
    with; other tensors (and every tensor of a run without LoRA) as they are. In place."""
    if ckpt.lora is None:
        return tensors
    metadata = SafeFileSystemReader(ckpt.path).read_metadata().state_dict_metadata
    modules = [
        name.removesuffix(".weight") for name in tensors if f"model.{name.removesuffix('.weight')}.lora_A" in metadata
    ]
    factors = {
        f"{module}.{part}": torch.empty(metadata[f"model.{module}.{part}"].size, dtype=torch.float32)
        for module in modules
        for part in ("lora_A", "lora_B")
    }
    if factors:
        read_state(ckpt.path, {"model": factors})
    scaling = ckpt.lora.alpha / ckpt.lora.rank
    for module in modules:
        weight = tensors[f"{module}.weight"]
        delta = factors[f"{module}.lora_B"] @ factors[f"{module}.lora_A"] * scaling
        weight.copy_((weight.float() + delta).to(weight.dtype))
    return tensors
