"""`forge eval`: a checkpoint on downstream tasks and/or perplexity over a data set, recorded in its run.

Nothing is written before the evaluation has finished. What can be refused cheaply is checked before the
model is loaded: the options, the checkpoint (a run without one is refused), the task names (unknown ones
with the closest names) and the tasks' data (a data set an offline machine does not hold, naming it).

A process started by `forge eval --nproc-per-node N` (or torchrun, srun) joins its process group, loads the
whole model and computes its share of the forwards and generations (engine.eval.split): every process ends
with the numbers one process gets, and rank 0 alone records them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.checkpoint.hf import is_hf_folder
from engine.checkpoint.layout import STEP_DIR
from engine.checkpoint.locate import find_checkpoint
from engine.errors import UserError
from engine.eval.record import append_record, run_dir_of
from engine.eval.split import ALONE, WorkSplit

if TYPE_CHECKING:
    import torch

    from engine.eval.perplexity import Perplexity
    from engine.eval.suite import TaskRun


@dataclass(frozen=True)
class EvalRequest:
    tasks: tuple[str, ...] = ()
    data: str | None = None  # perplexity over this source (engine.interp.tokens spellings)
    num_fewshot: int | None = None
    limit: int | None = None
    batch_size: int = 8
    include_path: tuple[Path, ...] = ()
    stride: int | None = None
    max_tokens: int | None = None
    record: bool = True  # append the results to the run directory's evals.jsonl


@dataclass
class EvalReport:
    checkpoint: str
    step: int | None
    run_dir: Path | None  # where the results were recorded (None: not a run's checkpoint, or not asked)
    tasks: TaskRun | None = None
    perplexity: Perplexity | None = None
    records: list[dict] = field(default_factory=list)


def evaluate(target: Path, request: EvalRequest, progress: Callable[[int], None] | None = None) -> EvalReport:
    """Evaluate the checkpoint `target` names (run directory: its newest complete one; checkpoint folder;
    step_N; Hugging Face folder) as `request` asks; record the results in its run directory. In a process of a
    multi-process evaluation, its share (see the module docstring); only rank 0 records."""
    checkpoint, step, run_dir, tasks = prepare(target, request)
    split, device = join_if_launched()
    from engine.generate import load_model

    model, encoder = load_model(checkpoint, device)
    report = EvalReport(str(checkpoint), step, run_dir if request.record and split.rank == 0 else None)
    if tasks is not None:
        from engine.eval.harness import ForgeLM
        from engine.eval.suite import run_loaded

        lm = ForgeLM(model, encoder, request.batch_size, progress, split)
        report.tasks = run_loaded(lm, *tasks, request.num_fewshot, request.limit, split=split)
    if request.data is not None:
        from engine.eval.perplexity import perplexity

        report.perplexity = perplexity(
            model, encoder, request.data, request.stride, request.max_tokens, request.batch_size, progress, split
        )
    split.wait()  # every process is done with the others before rank 0 writes and any process exits
    if report.run_dir is not None:
        report.records = [append_record(report.run_dir, r) for r in records(report, request)]
    return report


def prepare(target: Path, request: EvalRequest) -> tuple[Path, int | None, Path | None, tuple[Any, list] | None]:
    """Everything that can be refused before a model is loaded or a process started: → the checkpoint folder,
    its step, its run directory, and (the harness's task manager, the loaded tasks) when tasks are asked for."""
    if not request.tasks and request.data is None:
        raise UserError("nothing to evaluate", "pass --tasks T1,T2 and/or --data SOURCE")
    if request.batch_size < 1:
        raise UserError(f"--batch-size {request.batch_size} must be at least 1")
    check_options(request.num_fewshot, request.limit)
    checkpoint, step, run_dir = resolve(target)
    if not request.tasks:
        return checkpoint, step, run_dir, None
    require_harness()
    from engine.eval.suite import load_tasks, task_manager

    manager = task_manager(list(request.tasks), list(request.include_path))
    return checkpoint, step, run_dir, (manager, load_tasks(manager, list(request.tasks)))


BACKENDS = "cpu:gloo,cuda:nccl"
JOIN_TIMEOUT_S = 1800.0  # the processes meet after every share of forwards: the slowest share's time


def join_if_launched() -> tuple[WorkSplit, torch.device]:
    """A process started as one of several joins their process group (once) and takes its share, on its own
    GPU; a process alone does everything on the default device."""
    import torch.distributed as dist

    from engine.generate import default_device
    from engine.parallel.launch import device_for, join_process_group
    from engine.parallel.place import process_place

    place = process_place()
    if place.world_size == 1:
        return ALONE, default_device()
    device = device_for(place)
    if not dist.is_initialized():
        join_process_group(BACKENDS, JOIN_TIMEOUT_S, device)
    return WorkSplit(place.rank, place.world_size), device


def check_options(num_fewshot: int | None, limit: int | None) -> None:
    if num_fewshot is not None and num_fewshot < 0:
        raise UserError(f"--num-fewshot {num_fewshot} is negative", "use 0 for zero-shot")
    if limit is not None and limit < 1:
        raise UserError(f"--limit {limit} must be at least 1", "leave it out to use every document")


def require_harness() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(
            "--tasks needs lm-evaluation-harness (the lm_eval package), which is not installed",
            "pip install 'forge-lm[eval]' (or pip install lm-eval)",
        ) from None


def resolve(target: Path) -> tuple[Path, int | None, Path | None]:
    """(the checkpoint folder evaluated, its step, its run directory) — a missing or incomplete checkpoint is
    refused here, before anything is loaded."""
    if is_hf_folder(target):
        return target, None, None
    ckpt = find_checkpoint(target)
    match = STEP_DIR.match(ckpt.path.name)
    return ckpt.path, int(match.group(1)) if match else None, run_dir_of(ckpt.path)


def records(report: EvalReport, request: EvalRequest) -> list[dict]:
    """What goes into evals.jsonl (engine/eval/record.py)."""
    base = {"step": report.step, "checkpoint": report.checkpoint}
    out = []
    if report.tasks is not None:
        run = report.tasks
        out.append(
            {
                **base,
                "kind": "tasks",
                "tasks": list(request.tasks),
                "num_fewshot": run.num_fewshot,
                "limit": request.limit,
                "samples": run.samples,
                "metrics": {r.key: r.value for r in run.results},
                "stderr": {r.key: r.stderr for r in run.results if r.stderr is not None},
            }
        )
    if report.perplexity is not None:
        p = report.perplexity
        out.append(
            {
                **base,
                "kind": "perplexity",
                "data": p.data,
                "stride": p.stride,
                "tokens": p.tokens,
                "bytes": p.bytes,
                "metrics": {
                    f"{p.data}/perplexity": p.perplexity,
                    f"{p.data}/bits_per_byte": p.bits_per_byte,
                    f"{p.data}/loss": p.loss,
                },
            }
        )
    return out
