"""The rules for a run's length and batch (train.max_steps | max_epochs | max_tokens, global_batch_size and its
ramp, scheduler.unit, eval.steps = "all"), torch-free. `issues` is what `JobConfig.validate` adds for them; the
other cross-field rules read the derived max_steps and grad_accum_steps (engine/plan/length.py), so they run
once these pass. `warnings` likewise for `JobConfig.warnings`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.data.batch_plan import data_parallel, global_sequences
from engine.errors import ConfigIssue, UserError

if TYPE_CHECKING:
    from engine.config.job import JobConfig

RAMP_DETAILS = ("batch_ramp_increment", "batch_ramp_steps", "batch_ramp_tokens")


def issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    return (
        length_issues(cfg) + (batch_issues(cfg, world_size) or ramp_issues(cfg, world_size)) + unsupported_issues(cfg)
    )


def length_issues(cfg: JobConfig) -> list[ConfigIssue]:
    """One way of saying how long: max_steps, max_epochs or max_tokens; epochs only of one data set whose
    size is known before training."""
    t, d = cfg.train, cfg.data
    given = [name for name in ("max_steps", "max_epochs", "max_tokens") if getattr(t, name) is not None]
    found = [
        ConfigIssue(
            f"train.{name}",
            f"and train.{given[0]} are both set",
            f"say how long the run is once: remove train.{name} or train.{given[0]}",
        )
        for name in given[1:]
    ]
    if t.max_epochs is None or found:
        return found
    if d.datasets:
        found.append(
            ConfigIssue(
                "train.max_epochs",
                "counts passes over one data set, but data.datasets mixes several, each drawn at its own rate "
                "(the data/epochs/NAME metrics show each source's passes)",
                "set train.max_tokens (or max_steps) for a mixture",
            )
        )
    elif d.hf_dataset_name is not None:
        found.append(
            ConfigIssue(
                "train.max_epochs",
                "needs the data's size, which data.hf_dataset_name has only once tokenized (during the run)",
                "tokenize it first (forge tokenize hf:NAME --out DIR) and set data.dataset_path, or set train.max_tokens",
            )
        )
    else:
        from engine.plan.length import train_windows

        try:
            windows = train_windows(cfg)
        except UserError as err:  # a DataError, an unknown source kind, a remote manifest that cannot be read
            found.append(ConfigIssue("train.max_epochs", f"needs the training data's size: {err.message}", err.hint))
        else:
            if windows == 0:
                found.append(
                    ConfigIssue(
                        "train.max_epochs",
                        f"the training data has no window of train.seq_len + 1 = {t.seq_len + 1} tokens",
                        "lower train.seq_len or tokenize more text",
                    )
                )
    return found


def batch_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """A global batch is whole micro-batches on every data-parallel rank, and agrees with grad_accum_steps."""
    t = cfg.train
    if t.global_batch_size is None:
        return []
    dp = data_parallel(cfg, world_size)
    unit = t.batch_size * dp
    if t.global_batch_size % unit:
        return [
            ConfigIssue(
                "train.global_batch_size",
                f"{t.global_batch_size} is not a multiple of train.batch_size × data-parallel ranks = "
                f"{t.batch_size} × {dp} = {unit}: each optimizer step is whole micro-batches on every rank",
                f"use a multiple of {unit} (e.g. {max(unit, t.global_batch_size // unit * unit)}), or change "
                "train.batch_size",
            )
        ]
    if t.grad_accum_steps is not None and t.grad_accum_steps * unit != t.global_batch_size:
        return [
            ConfigIssue(
                "train.grad_accum_steps",
                f"{t.grad_accum_steps} disagrees with train.global_batch_size = {t.global_batch_size}: "
                f"{t.batch_size} × {dp} ranks × {t.grad_accum_steps} = {t.grad_accum_steps * unit} sequences",
                f"remove train.grad_accum_steps (it is derived: {t.global_batch_size // unit}), or one of the two",
            )
        ]
    return []


def ramp_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """A ramp from batch_ramp_start to the global batch, in whole micro-batches on every rank, over a length
    given once."""
    t = cfg.train
    if t.batch_ramp_start is None:
        return [
            ConfigIssue(f"train.{name}", "is set, but train.batch_ramp_start is unset", "set it, or remove this")
            for name in RAMP_DETAILS
            if getattr(t, name) is not None
        ]
    if t.global_batch_size is None:
        return [
            ConfigIssue(
                "train.batch_ramp_start",
                "needs train.global_batch_size, the batch the ramp ends at",
                "set train.global_batch_size",
            )
        ]
    found = []
    if (t.batch_ramp_steps is None) == (t.batch_ramp_tokens is None):
        both = t.batch_ramp_steps is not None
        found.append(
            ConfigIssue(
                "train.batch_ramp_steps",
                "and train.batch_ramp_tokens are both set" if both else "is unset, and so is train.batch_ramp_tokens",
                "give the ramp's length once, in steps or in tokens",
            )
        )
    full, dp = global_sequences(cfg, world_size), data_parallel(cfg, world_size)
    unit = t.batch_size * dp
    increment = t.batch_ramp_increment or t.batch_ramp_start
    for name, value in (("batch_ramp_start", t.batch_ramp_start), ("batch_ramp_increment", t.batch_ramp_increment)):
        if value is not None and value % unit:  # (an unset increment is the start: one problem, said once)
            found.append(
                ConfigIssue(
                    f"train.{name}",
                    f"{value} is not a multiple of train.batch_size × data-parallel ranks = {t.batch_size} × {dp} "
                    f"= {unit}: every step of the ramp is whole micro-batches on every rank",
                    f"use a multiple of {unit}",
                )
            )
    if t.batch_ramp_start >= full:
        found.append(
            ConfigIssue(
                "train.batch_ramp_start",
                f"{t.batch_ramp_start} is not below train.global_batch_size = {full}",
                "start the ramp at a smaller batch, or remove it",
            )
        )
    elif (full - t.batch_ramp_start) % increment and not any(i.path != "train.batch_ramp_steps" for i in found):
        found.append(
            ConfigIssue(
                "train.batch_ramp_increment",
                f"rises of {increment} do not lead from train.batch_ramp_start = {t.batch_ramp_start} to "
                f"train.global_batch_size = {full} (a difference of {full - t.batch_ramp_start})",
                f"use an increment that divides {full - t.batch_ramp_start}",
            )
        )
    return found


def unsupported_issues(cfg: JobConfig) -> list[ConfigIssue]:
    """Combinations that do not work yet, refused with the reason."""
    t, s, d = cfg.train, cfg.scheduler, cfg.distributed
    found = []
    ramp = t.batch_ramp_start is not None
    unsupported = [
        (
            ramp and d.pp > 1,
            "train.batch_ramp_start",
            "a batch ramp is not supported with pipeline parallelism (distributed.pp > 1) yet: the pipeline "
            "schedule is built for a fixed number of micro-batches",
            "remove the ramp, or train with distributed.pp = 1",
        ),
        (
            s.unit == "tokens" and s.cycles is not None,
            "scheduler.cycles",
            'warm restarts are counted in steps; scheduler.unit = "tokens" does not support them yet',
            'remove scheduler.cycles, or use scheduler.unit = "steps"',
        ),
        (
            cfg.eval.enabled and cfg.eval.steps == "all" and d.pp > 1,
            "eval.steps",
            '"all" is not supported with pipeline parallelism (distributed.pp > 1) yet: the held-out set '
            "does not divide into the pipeline's passes",
            "give a number of batches (a multiple of train.grad_accum_steps)",
        ),
    ]
    for applies, field, problem, hint in unsupported:
        if applies:
            found.append(ConfigIssue(field, problem, hint))
    return found


def warnings(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """`cfg` derived (engine/plan/length.py): a schedule in tokens that never leaves its warmup."""
    from engine.data.batch_plan import batch_plan

    s = cfg.scheduler
    if s.unit != "tokens" or s.name == "none":
        return []
    total = batch_plan(cfg, world_size).tokens_before(cfg.train.max_steps)
    if s.warmup_steps < total:
        return []
    return [
        ConfigIssue(
            "scheduler.warmup_steps",
            f"{s.warmup_steps:,} tokens >= the run's {total:,} tokens (scheduler.unit = 'tokens'): the whole run "
            "warms up and the learning rate never reaches optimizer.lr",
            "shorten the warmup or train longer",
        )
    ]
