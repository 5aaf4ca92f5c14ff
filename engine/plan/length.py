"""How long a run trains and how big its steps are, in the terms a recipe states them: a global batch (with a
ramp), epochs, tokens. Everything here is derived from the config, the world size and (for epochs) the
training data's window count, without torch, so validate-config shows exactly what `forge train` will do.

`with_derived_length` fills in what the user left to derivation: `train.grad_accum_steps` (the full batch's
accumulation, from global_batch_size) and `train.max_steps` (from max_tokens or max_epochs). The run directory
records the config as the user gave it (`as_given`): a derived accumulation belongs to the layout, and a resume
in another layout derives its own; derived steps are derived again from the same data (a resume checks the
data is the same).
"""

from __future__ import annotations

from fnmatch import fnmatch
from typing import TYPE_CHECKING

from engine.data.batch_plan import accumulation, batch_plan

if TYPE_CHECKING:
    from engine.config.job import JobConfig

DERIVED = ("max_steps", "grad_accum_steps")


def train_windows(cfg: JobConfig) -> int:
    """Training windows (seq_len + 1 tokens, whole inside a shard) of the one data set max_epochs counts: the
    shards of data.dataset_path (a folder, an embedded split, a remote data set) matching data.file_pattern,
    or the embedded corpus; read from the manifest (a remote one without fetching the shards), as
    `engine.data.loader` counts them. Raises DataError when the shards are not there."""
    from engine.data.source_kinds import source_manifest, train_sources

    d, window = cfg.data, cfg.train.seq_len + 1
    shards = [s for s in source_manifest(cfg, train_sources(cfg)[0]).shards if fnmatch(s.file, d.file_pattern)]
    return sum(s.tokens // window for s in shards)


def derived_steps(cfg: JobConfig, world_size: int, windows: int | None = None) -> int:
    """max_steps, or the steps that max_tokens or max_epochs come to (rounded up: the last step may reach a
    little past the budget, into the next epoch)."""
    t = cfg.train
    if t.max_steps is not None:
        return t.max_steps
    plan = batch_plan(cfg, world_size)
    if t.max_tokens is not None:
        return plan.steps_for_tokens(t.max_tokens)
    assert t.max_epochs is not None, "TrainConfig sets max_steps when neither max_tokens nor max_epochs is"
    windows = train_windows(cfg) if windows is None else windows
    return plan.steps_for_tokens(t.max_epochs * windows * t.seq_len)


def with_derived_length(cfg: JobConfig, world_size: int, windows: int | None = None) -> JobConfig:
    """`cfg` (validated) with grad_accum_steps and max_steps filled in; unchanged when the user set both."""
    t = cfg.train
    update = {}
    if t.grad_accum_steps is None:
        update["grad_accum_steps"] = accumulation(cfg, world_size)
    if t.max_steps is None:
        update["max_steps"] = derived_steps(cfg, world_size, windows)
    if not update:
        return cfg
    return cfg.model_copy(update={"train": t.model_copy(update=update)})


def as_given(resolved: JobConfig, given: JobConfig) -> JobConfig:
    """`resolved` with the derived fields back as the user gave them (unset): what the run directory records."""
    update = {name: getattr(given.train, name) for name in DERIVED if getattr(given.train, name) is None}
    if not update:
        return resolved
    return resolved.model_copy(update={"train": resolved.train.model_copy(update=update)})


def in_recipe_terms(cfg: JobConfig) -> bool:
    """Whether the config says its batch or length the derived way (validate-config then shows the derivation)."""
    t = cfg.train
    return any(value is not None for value in (t.global_batch_size, t.batch_ramp_start, t.max_epochs, t.max_tokens))


def length_summary(cfg: JobConfig, world_size: int, windows: int | None = None) -> dict:
    """What validate-config shows about the batch and the run's length (`cfg` already derived): the global
    batch, the accumulation, the ramp's levels, and how max_steps came about."""
    t = cfg.train
    plan = batch_plan(cfg, world_size)
    summary: dict = {
        "global_batch_size": plan.full,
        "grad_accum_steps": plan.full // plan.unit,
        "max_steps": t.max_steps,
        "batch_ramp": plan.ramp_rows(t.max_steps) if plan.ramp is not None else [],
    }
    if t.max_epochs is not None:
        windows = train_windows(cfg) if windows is None else windows
        summary["max_steps_from"] = f"{t.max_epochs} epoch(s) of {windows:,} training windows"
    elif t.max_tokens is not None:
        summary["max_steps_from"] = f"{t.max_tokens:,} tokens"
    return summary
