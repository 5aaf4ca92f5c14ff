"""From what a user points at (a run directory, a checkpoint folder, one step_N folder) to one complete
checkpoint, the model config it was saved with, and the tokenizer that goes with it.

Where the model config comes from:
  - a run directory's `config.toml` (what `forge train` writes), for its own checkpoint folder;
  - `model.toml` in a checkpoint folder written by `forge convert from-hf`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.checkpoint.dcp import COMPLETE, STEP_DIR, latest_checkpoint, step_dirs
from engine.config.loader import load_job_config
from engine.config.model import ModelConfig
from engine.errors import UserError

RUN_CONFIG = "config.toml"
MODEL_CONFIG = "model.toml"  # the [model] section beside a checkpoint folder that has no run directory
TOKENIZER = "tokenizer.json"


@dataclass(frozen=True)
class ForgeCheckpoint:
    path: Path                # the step_N folder
    model: ModelConfig
    tokenizer: Path | None    # a tokenizer.json, when the run had one


def find_checkpoint(target: Path) -> ForgeCheckpoint:
    """Resolve a run directory, a checkpoint folder or a step_N folder; a UserError says what is wrong."""
    if not target.exists():
        raise UserError(f"{target} does not exist", "pass a run directory (forge train --run-dir) or a checkpoint folder")
    if not target.is_dir():
        raise UserError(f"{target} is a file, not a run directory or checkpoint folder",
                        "pass the folder forge train wrote, e.g. runs/debug")
    if (target / RUN_CONFIG).is_file():
        cfg = load_job_config(target / RUN_CONFIG)
        step = newest_complete(target / cfg.checkpoint.dir, f"run {target}")
        return ForgeCheckpoint(step, cfg.model, tokenizer_in(target))
    if STEP_DIR.match(target.name):
        if not (target / COMPLETE).is_file():
            raise UserError(f"checkpoint {target} is incomplete (its save was interrupted)",
                            "use an older step_N folder, or the checkpoint folder to pick the newest complete one")
        return with_config(target, target.parent)
    if step_dirs(target) or (target / MODEL_CONFIG).is_file():
        return with_config(newest_complete(target, f"checkpoint folder {target}"), target)
    if (target / "config.json").is_file():
        raise UserError(f"{target} is a Hugging Face model folder, not a Forge checkpoint",
                        "convert it first: forge convert from-hf HF_DIR --out CKPT")
    raise UserError(f"{target} is not a Forge run directory or checkpoint folder (no {RUN_CONFIG}, no step_N folders)",
                    "pass the folder forge train wrote (e.g. runs/debug), its checkpoints/ folder, or one step_N in it")


def newest_complete(root: Path, what: str) -> Path:
    newest = latest_checkpoint(root)
    if newest is None:
        raise UserError(f"{what} has no complete checkpoint in {root}",
                        "train until a checkpoint is saved (checkpoint.interval, or the end of the run)")
    return newest[1]


def with_config(step: Path, root: Path) -> ForgeCheckpoint:
    """The model config of a checkpoint folder: its own model.toml, else the nearest run directory above
    it whose config names this folder as its checkpoint folder."""
    if (root / MODEL_CONFIG).is_file():
        return ForgeCheckpoint(step, load_job_config(root / MODEL_CONFIG).model, tokenizer_in(root))
    run_dir = next((p for p in root.parents if (p / RUN_CONFIG).is_file()), None)
    if run_dir is not None:
        cfg = load_job_config(run_dir / RUN_CONFIG)
        if (run_dir / cfg.checkpoint.dir).resolve() == root.resolve():
            return ForgeCheckpoint(step, cfg.model, tokenizer_in(run_dir))
    raise UserError(f"cannot find the model config of checkpoint {step} (no {MODEL_CONFIG} in {root} and no run "
                    f"directory above it whose {RUN_CONFIG} saves checkpoints there)",
                    "pass the run directory instead")


def tokenizer_in(folder: Path) -> Path | None:
    path = folder / TOKENIZER
    return path if path.is_file() else None
