"""`forge eval`: downstream tasks through lm-evaluation-harness and perplexity on text, for one checkpoint.
The work is in `engine.eval`."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.cells import cell_len
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from engine.run_files import EVALS_FILE
from forgecli.extract import split
from forgecli.ui import LiveBar, PlainLines, console, err_console, print_json, print_wide, user_errors

if TYPE_CHECKING:
    from engine.eval.evaluate import EvalReport


@user_errors
def eval_command(
    target: Path = typer.Argument(
        ...,
        metavar="RUN_DIR|CKPT",
        help="A run directory (its newest complete checkpoint), a checkpoint folder, one step_N folder, "
        "or a Hugging Face model folder.",
    ),
    tasks: list[str] = typer.Option(
        None,
        "--tasks",
        "-t",
        help="Tasks: lm-evaluation-harness names (hellaswag, arc_easy, …), Forge's own (forge_next_line), or "
        "task YAML files. Repeat or separate with commas.",
    ),
    data: str | None = typer.Option(
        None,
        "--data",
        "-d",
        help="Perplexity and bits per byte on this text: a forge tokenize output folder (local or a URL), "
        "text/JSONL/Parquet files or a folder (local or a URL), hf:NAME, or embedded:val (the embedded corpus's "
        "held-out works): spelled as a config's data.dataset_path is.",
    ),
    num_fewshot: int | None = typer.Option(
        None, "--num-fewshot", help="Examples in each prompt \\[default: each task's own, usually 0]."
    ),
    limit: int | None = typer.Option(None, "--limit", help="Evaluate the first N documents of each task only."),
    batch_size: int = typer.Option(
        8,
        "--batch-size",
        "-b",
        help="Rows per forward, each as long as the longest request (short requests share a row).",
    ),
    include_path: list[Path] = typer.Option(
        None, "--include-path", help="A folder of task YAML files to look task names up in too (repeatable)."
    ),
    stride: int | None = typer.Option(
        None,
        "--stride",
        help="--data: tokens each window moves on; shorter than the context gives every token more context "
        "\\[default: the model's max_seq_len, disjoint windows].",
    ),
    max_tokens: int | None = typer.Option(None, "--max-tokens", help="--data: only the first N tokens."),
    no_record: bool = typer.Option(False, "--no-record", help="Do not append the results to RUN_DIR/evals.jsonl."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    nproc_per_node: int = typer.Option(
        1,
        "--nproc-per-node",
        min=1,
        help="Processes sharing the evaluation (one per GPU), started by PyTorch's elastic launcher; the same "
        "numbers as one process.",
    ),
) -> None:
    """Evaluate a checkpoint on downstream tasks (lm-evaluation-harness) and/or perplexity on text.

    The model runs natively (one device, fp32) and gives the numbers lm-eval's own Hugging Face model
    gives on the `forge convert to-hf` export. A request longer than the model's context is cut from the
    left (its oldest tokens dropped), as the harness does. Results are appended to the run directory's
    evals.jsonl, which `forge runs` and `forge runs compare` show. Offline: Forge's tasks, task YAML files
    and --include-path folders with local data need no network.

    [bold]Examples[/bold]

      forge eval runs/debug --tasks forge_next_line

      forge eval runs/debug --tasks my_tasks/quiz.yaml --limit 200 --json

      forge eval runs/big --tasks hellaswag,arc_easy --num-fewshot 5 --include-path my_tasks

      forge eval runs/debug --data embedded:val --stride 128

      forge eval runs/big --tasks hellaswag --nproc-per-node 8

    """
    # The harness's own progress bars (ours is below): tqdm reads this when it is first imported, which
    # importing engine.eval does, so it is set first.
    os.environ.setdefault("TQDM_DISABLE", "1")
    from engine.eval.evaluate import EvalRequest, evaluate, prepare
    from engine.parallel.place import process_place

    request = EvalRequest(
        tasks=split(tasks),
        data=data,
        num_fewshot=num_fewshot,
        limit=limit,
        batch_size=batch_size,
        include_path=tuple(include_path or ()),
        stride=stride,
        max_tokens=max_tokens,
        record=not no_record,
    )
    if nproc_per_node > 1:
        from forgecli.train import check_not_launched

        check_not_launched()  # not inside a process torchrun or srun started
        prepare(target, request)  # bad input exits 2 here, before any process starts
        launch(nproc_per_node)
    if process_place().rank != 0:  # the other processes of a multi-process evaluation compute and say nothing
        evaluate(target, request)
        return
    with progress_view(as_json) as view:
        report = evaluate(target, request, progress=view.update)
    show(report, as_json)


def launch(nproc: int) -> None:
    """This same command line once per process (each takes its share); exit with their exit code."""
    from engine.parallel.launch import launch_local_workers
    from forgecli.train import check_gpus_for, worker_argv

    check_gpus_for(nproc)
    code = launch_local_workers(nproc, "forgecli.app", worker_argv(sys.argv[1:]), 30.0, 1, ())
    raise typer.Exit(code)


def show(report: EvalReport, as_json: bool) -> None:
    if as_json:
        print_json(report_json(report))
        return
    title = f"{escape(report.checkpoint)}" + (f" (step {report.step})" if report.step is not None else "")
    if report.tasks is not None:
        table = Table(title=title, min_width=cell_len(title))  # a checkpoint's path, never wrapped mid-name
        for column, justify in (("task", "left"), ("metric", "left"), ("value", "right"), ("stderr", "right")):
            table.add_column(column, justify=justify, no_wrap=True)
        for r in report.tasks.results:
            metric = r.metric if r.filter == "none" else f"{r.metric} ({r.filter})"
            table.add_row(
                escape(r.task), escape(metric), f"{r.value:.4f}", "-" if r.stderr is None else f"± {r.stderr:.4f}"
            )
        print_wide(table)
    if report.perplexity is not None:
        p = report.perplexity
        named = f"{title}: {escape(p.data)}"
        table = Table(title=named, show_header=False, min_width=cell_len(named))
        table.add_column(style="bold")
        table.add_column(justify="right")
        table.add_row("perplexity", f"{p.perplexity:.4f}")
        table.add_row("bits per byte", f"{p.bits_per_byte:.4f}")
        table.add_row("loss (nats/token)", f"{p.loss:.4f}")
        table.add_row("tokens", f"{p.tokens:,} in {p.windows:,} windows (stride {p.stride})")
        print_wide(table)
    if report.run_dir is not None:
        console.print(f"recorded in {report.run_dir / EVALS_FILE}", markup=False, highlight=False)


def report_json(report: EvalReport) -> dict:
    out: dict = {"checkpoint": report.checkpoint, "step": report.step}
    if report.tasks is not None:
        out["results"] = [
            {"task": r.task, "metric": r.metric, "filter": r.filter, "value": r.value, "stderr": r.stderr}
            for r in report.tasks.results
        ]
        out["samples"] = report.tasks.samples
        out["num_fewshot"] = report.tasks.num_fewshot
    if report.perplexity is not None:
        p = report.perplexity
        out["perplexity"] = {
            "data": p.data,
            "perplexity": p.perplexity,
            "bits_per_byte": p.bits_per_byte,
            "loss": p.loss,
            "tokens": p.tokens,
            "bytes": p.bytes,
            "windows": p.windows,
            "stride": p.stride,
        }
    out["recorded_in"] = None if report.run_dir is None else str(report.run_dir / EVALS_FILE)
    return out


def progress_view(as_json: bool) -> RichProgressView | PlainProgressView:
    target = err_console if as_json else console
    if target.is_terminal and not target.is_dumb_terminal:
        return RichProgressView(target)
    return PlainProgressView(target)


class RichProgressView(LiveBar):
    """Requests answered so far (the harness hands them over task by task, so there is no total)."""

    def __init__(self, target) -> None:
        self.done = 0
        self.bar = Progress(
            SpinnerColumn(), TextColumn("evaluating: {task.completed:,} requests"), TimeElapsedColumn(), console=target
        )
        self.bar.transient = True
        self.task = self.bar.add_task("evaluating", total=None)

    def update(self, done: int) -> None:
        self.bar.advance(self.task, done)


class PlainProgressView(PlainLines):
    """For logs: a line every 10 s, none for an evaluation quicker than that."""

    def __init__(self, target) -> None:
        self.target, self.done = target, 0
        self.last_line = time.perf_counter()

    def update(self, done: int) -> None:
        self.done += done
        if self.due():
            self.say(f"evaluating: {self.done:,} requests answered")
