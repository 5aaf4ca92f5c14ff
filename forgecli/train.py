"""`forge train`: train a preset into a run directory, or continue the run already there."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from forgecli.completion import complete_preset
from forgecli.dashboard import LiveDashboard, PlainReporter
from forgecli.overrides import collect_overrides
from forgecli.ui import (
    console,
    err_console,
    is_interactive,
    print_json,
    show_config_warnings,
    show_run_failure,
    user_errors,
)

if TYPE_CHECKING:
    from engine.config import JobConfig
    from engine.data.tokenize import Progress as TokenizeProgress


# The options `forge train` and `forge resume` share.
SummaryAsJson = Annotated[
    bool, typer.Option("--json", help="Print the final summary as JSON on stdout (progress lines go to stderr).")
]
NprocPerNode = Annotated[
    int,
    typer.Option(
        "--nproc-per-node", min=1, help="Processes on this node (one per GPU), started by PyTorch's elastic launcher."
    ),
]
AllowCode = Annotated[
    bool,
    typer.Option(
        "--allow-code",
        help="Run the code a saved config (a run directory's config.toml) names: its train.hooks and eval.tasks "
        "task files, and hook modules found inside a run directory. Only for a run directory you trust.",
    ),
]


@user_errors
def train(
    ctx: typer.Context,
    preset: Path = typer.Argument(..., help="TOML preset (or a run's config.toml).", autocompletion=complete_preset),
    run_dir: Path | None = typer.Option(
        None, "--run-dir", help="Where the run is written. Default: runs/<preset name>."
    ),
    as_json: SummaryAsJson = False,
    nproc_per_node: NprocPerNode = 1,
    allow_code: AllowCode = False,
) -> None:
    """Train a model into a run directory (config, metrics, logs, checkpoints).

    If the run directory already holds a run of this config, it resumes from its newest complete
    checkpoint. Overrides as --section.key=value, values as TOML literals (--optimizer.betas=[0.9,0.95]).
    A run's config.toml as the preset runs none of the code it names (hooks, task files) without --allow-code.

    [bold]Examples[/bold]

      forge train presets/debug.toml

      forge train presets/debug.toml --train.max_steps=50 --optimizer.lr=1e-3 --run-dir runs/lr1e-3

      forge train presets/debug.toml --nproc-per-node 2

    """
    from engine.config import load_job_config
    from engine.train.run_dir import is_saved_config, refuse_saved_code

    overrides = collect_overrides(ctx.args)
    cfg = load_job_config(preset, overrides)
    if is_saved_config(preset):
        refuse_saved_code(cfg, overrides, preset, allow_code)
    if nproc_per_node > 1:
        launch(cfg, nproc_per_node)
    run_training(cfg, run_dir or Path("runs") / preset.stem, as_json, allow_code)


def launch(cfg: JobConfig, nproc: int) -> None:
    """Check the layout for `nproc` processes here (a bad one exits 2 before anything starts), then run
    this same command line once per process and exit with the run's exit code."""
    from engine.parallel.launch import launch_local_workers
    from engine.plan import resolve
    from engine.resilience.signals import PREEMPTED_EXIT, SIGNALS

    check_not_launched()
    resolve(cfg, nproc)  # each process resolves its own when it starts
    check_gpus_for(nproc)
    code = launch_local_workers(
        nproc, "forgecli.app", worker_argv(sys.argv[1:]), cfg.train.shutdown_timeout_sec, PREEMPTED_EXIT, tuple(SIGNALS)
    )
    raise typer.Exit(code)


def check_not_launched() -> None:
    """--nproc-per-node starts the processes: refused in a process torchrun or srun already started (each of
    them would start its own group of processes)."""
    from engine.errors import UserError
    from engine.parallel.place import process_place

    world = process_place().world_size
    if world > 1:
        raise UserError(
            f"--nproc-per-node is for starting a run, but this process is already one of {world} "
            "(started by torchrun or srun)",
            "drop --nproc-per-node",
        )


def check_gpus_for(nproc: int) -> None:
    """One process per GPU: say so before starting more processes than this machine has GPUs."""
    import torch

    from engine.errors import UserError

    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise UserError(
            f"--nproc-per-node {nproc} starts one process per GPU, but this machine has {torch.cuda.device_count()}",
            f"use --nproc-per-node {torch.cuda.device_count()} or fewer",
        )


def resume_launch_hint() -> str:
    """How the resume command must be started to get this run's processes again."""
    from engine.parallel.place import process_place

    world = process_place().world_size
    if world == 1:
        return ""
    if os.environ.get("TORCHELASTIC_RUN_ID") and int(os.environ.get("LOCAL_WORLD_SIZE", "0")) == world:
        return f" --nproc-per-node {world}"
    return f" (started the way this run was, {world} processes)"


def allow_code_flag(cfg: JobConfig) -> str:
    """` --allow-code` where a resume of this run would need it: its saved config names code (hooks, task files)."""
    from engine.train.run_dir import saved_code_fields

    return " --allow-code" if saved_code_fields(cfg, []) else ""


def worker_argv(argv: list[str]) -> list[str]:
    """The command line without --nproc-per-node (each worker is one process)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out


@contextlib.contextmanager
def cache_build_bar(name: str) -> Iterator[Callable[[TokenizeProgress], None]]:
    """A dataset named in the config is tokenized into the cache before training starts (once): on a terminal
    with `forge tokenize`'s bar, which ends before the dashboard begins."""
    from forgecli.tokenize import RichProgressView

    with RichProgressView(console) as view:
        yield view.update


def run_training(cfg: JobConfig, run_dir: Path, as_json: bool, allow_code: bool = False) -> None:
    """Train with the console output that fits; shared by `forge train` and `forge resume`. `allow_code`:
    hook modules inside a run directory may be imported (--allow-code)."""
    from engine.parallel.place import process_place
    from engine.plan import resolve
    from engine.train.trainer import train as train_job

    place = process_place()
    main_rank = place.rank == 0  # the other ranks of a multi-process run print nothing
    resolved = resolve(cfg, place.world_size)
    if main_rank:
        show_config_warnings(list(resolved.warnings))
    live = main_rank and not as_json and is_interactive()
    if not main_rank:
        reporter = None
    elif as_json:  # stdout carries only the JSON summary; progress lines go to stderr
        reporter = PlainReporter(sys.stderr)
    else:
        reporter = LiveDashboard() if live else PlainReporter()
    from engine.checkpoint.manager import CheckpointWriteError
    from engine.data.hub_cache import progress_shown_by
    from engine.resilience.anomaly import TrainingDiverged
    from engine.resilience.health import CollectiveTimeout
    from engine.resilience.signals import PREEMPTED_EXIT, Preempted
    from engine.train.callbacks import CallbackFailed

    try:
        with progress_shown_by(cache_build_bar) if live else contextlib.nullcontext():
            summary = train_job(
                cfg, run_dir, [reporter] if reporter else [], allow_run_dir_code=allow_code, resolved=resolved
            )
    except Preempted as stopped:
        if not main_rank:
            raise typer.Exit(PREEMPTED_EXIT) from None
        err_console.print(
            f"stopped by {stopped.signal_name} at step {stopped.step}; checkpoint: "
            f"{stopped.checkpoint or 'none (the run resumes from its previous one)'}. "
            f"Continue with: forge resume {run_dir}{resume_launch_hint()}{allow_code_flag(cfg)}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(PREEMPTED_EXIT) from None
    except (TrainingDiverged, CollectiveTimeout, CheckpointWriteError, CallbackFailed) as err:
        show_run_failure(str(err))
        raise typer.Exit(1) from None
    finally:
        if isinstance(reporter, LiveDashboard):
            reporter.stop()
    if not main_rank:
        return
    if as_json:
        print_json(summary)
    elif summary.get("already_complete"):
        console.print(
            f"run {run_dir} is already complete at step {summary['steps']}; to train further (same schedule, "
            f"data and optimizer): forge resume {shlex.quote(str(run_dir))} --train.max_steps=N{allow_code_flag(cfg)} "
            f"(N > {summary['steps']})",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    else:
        console.print(f"run directory: {run_dir}", markup=False, highlight=False, soft_wrap=True)
