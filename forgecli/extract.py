"""`forge extract`: activations and attention weights of chosen modules over a data set, streamed to disk;
`forge extract compare`: layer × layer representation similarity. The work is in `engine.interp`."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from forgecli.ui import LiveBar, PlainLines, console, print_json, print_wide, user_errors

if TYPE_CHECKING:  # the engine is imported when a command runs, not when `forge --help` loads the app
    from engine.interp.extract import Progress as ExtractProgress
    from engine.interp.extract import Summary
    from engine.interp.similarity import Comparison


class ExtractGroup(typer.core.TyperGroup):
    """`forge extract RUN …` extracts, `forge extract compare A B` compares: a first word that names no
    subcommand (a run directory, an option) belongs to `run`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = ["run", *args]
        return super().parse_args(ctx, args)


app = typer.Typer(
    cls=ExtractGroup,
    help="Activations and attention weights of chosen layers over a data set, streamed to disk; and "
    "representation similarity (CKA, SVCCA, RSA) between layers. `forge extract RUN …` = `forge extract run RUN …`.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)


def split(values: list[str] | None) -> tuple[str, ...]:
    """Repeated options, each of which may also hold a comma-separated list."""
    return tuple(part.strip() for value in values or [] for part in value.split(",") if part.strip())


def integers(values: list[str] | None, flag: str) -> tuple[int, ...]:
    from engine.errors import UserError

    try:
        return tuple(int(v) for v in split(values))
    except ValueError:
        raise UserError(f"{flag} takes integers (got {' '.join(values or [])!r})", f"e.g. {flag} 0,3") from None


@app.command("run")
@user_errors
def run(
    target: Path = typer.Argument(
        ...,
        metavar="RUN_DIR|CKPT",
        help="A run directory (its newest complete checkpoint), a checkpoint folder, one step_N folder, "
        "or a Hugging Face model folder.",
    ),
    layers: list[str] = typer.Option(
        None,
        "--layers",
        "-l",
        help="Module names or globs (`*` within one dotted part): layers.3 (the residual stream after block 3), "
        "'layers.*', 'layers.*.attention', 'layers.*.feed_forward', tok_embeddings, norm, output. Repeat or "
        "separate with commas.",
    ),
    list_layers: bool = typer.Option(False, "--list-layers", help="Print the extractable modules with their shapes."),
    data: str | None = typer.Option(
        None,
        "--data",
        "-d",
        help="A forge tokenize output folder (local or a URL), text/JSONL/Parquet files or a folder (local or a "
        "URL), hf:NAME, or embedded:val (the embedded corpus's held-out works; also embedded:train, plays, "
        "poems): spelled as a config's data.dataset_path is.",
    ),
    text: str | None = typer.Option(None, "--text", help="One document to look at, instead of --data."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Output folder (rerun the same command to resume)."),
    seq_len: int | None = typer.Option(None, "--seq-len", help="Window length \\[default: the model's max_seq_len]."),
    batch_size: int = typer.Option(8, "--batch-size", "-b", help="Windows per forward."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", help="Stop after this many tokens of the data."),
    positions: str = typer.Option("all", "--positions", help="all: a row per token; last: one row per window."),
    step: int | None = typer.Option(None, "--step", help="Checkpoint step to load \\[default: the newest]."),
    dtype: str | None = typer.Option(
        None, "--dtype", help="Stored dtype: fp32, bf16 or fp16 \\[default: the compute dtype]."
    ),
    storage: str = typer.Option(
        "shards", "--format", help="shards: memory-mappable safetensors shards; npz: one activations.npz."
    ),
    shard_mb: float = typer.Option(256, "--shard-mb", help="Approximate size of one shard."),
    attention: list[str] = typer.Option(
        None, "--attention", help="Blocks whose attention weights softmax(QKᵀ/√d) to store, e.g. 'layers.*'."
    ),
    heads: list[str] = typer.Option(None, "--heads", help="Heads of --attention to keep \\[default: all]."),
    query_positions: list[str] = typer.Option(
        None,
        "--query-positions",
        help="Query positions of --attention (negative: from the window's end) \\[default: all].",
    ),
    routing: list[str] = typer.Option(
        None, "--routing", help="MoE blocks whose routing (chosen experts and their weights) to store per token."
    ),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", min=1, help="Processes splitting the data."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary (or the layer list) as JSON."),
) -> None:
    """Store what chosen modules compute over a data set, streamed to memory-mappable shards.

    Rows are tokens in order (window, position); the forward stops after the deepest requested module.
    A killed extraction resumes when the same command is run again; other arguments on an existing
    output folder are refused. Read it back with `from engine.interp import load_activations`.

    [bold]Examples[/bold]

      forge extract runs/debug --list-layers

      forge extract runs/debug --layers 'layers.*' --data data/tiny --max-tokens 20000 --out acts/debug

      forge extract runs/debug --layers layers.1 --text "ROMEO:" --attention layers.1 --heads 0,3 --out acts/romeo

      forge extract compare acts/debug --metric cka --plot cka.png

    """
    from engine.errors import UserError

    if list_layers:
        show_layers(target, step, as_json)
        return
    if out is None:
        raise UserError("--out is required", "name the output folder, e.g. --out acts/debug")
    if nproc_per_node > 1:
        launch(nproc_per_node)
    from engine.interp.extract import ExtractRequest, extract, join_if_launched

    request = ExtractRequest(
        layers=split(layers),
        data=data,
        text=text,
        seq_len=seq_len,
        batch_size=batch_size,
        max_tokens=max_tokens,
        positions=positions,
        dtype=dtype,
        step=step,
        storage=storage,
        shard_mb=shard_mb,
        attention=split(attention),
        heads=integers(heads, "--heads"),
        query_positions=integers(query_positions, "--query-positions"),
        routing=split(routing),
    )
    join_if_launched()
    from engine.parallel.place import process_place

    shown = process_place().rank == 0 and not as_json
    with progress_view(shown) as view:
        summary = extract(target, out, request, progress=view.update)
    if process_place().rank == 0:
        show(summary, as_json)


def launch(nproc: int) -> None:
    """This same command line once per process; exit with the run's exit code."""
    from engine.parallel.launch import launch_local_workers
    from forgecli.train import check_gpus_for, worker_argv

    check_gpus_for(nproc)
    code = launch_local_workers(nproc, "forgecli.app", worker_argv(sys.argv[1:]), 30.0, 1, ())
    raise typer.Exit(code)


def show_layers(target: Path, step: int | None, as_json: bool) -> None:
    from engine.interp.extract import list_layers

    outputs = list_layers(target, step)
    if as_json:
        print_json(
            {name: {"shape": o.shape, "dtype": str(o.dtype), "problem": o.problem} for name, o in outputs.items()}
        )
        return
    table = Table(title=f"modules of {escape(str(target))}")
    table.add_column("name", style="bold")
    table.add_column("output per token")
    table.add_column("dtype")
    for name, o in outputs.items():
        if o.shape is None:
            table.add_row(escape(name), f"[dim]— {escape(o.problem)}[/dim]", "")
        else:
            table.add_row(escape(name), "(" + ", ".join(map(str, o.shape)) + ")", str(o.dtype).removeprefix("torch."))
    print_wide(table)


def show(summary: Summary, as_json: bool) -> None:
    if as_json:
        print_json(
            {
                "out": str(summary.out),
                "layers": summary.layers,
                "rows": summary.rows,
                "tokens": summary.tokens,
                "shards_written": summary.shards_written,
                "shards_skipped": summary.shards_skipped,
                "resumed": summary.resumed,
                "bytes_written": summary.bytes,
                "columns": [{"name": c.name, "shape": list(c.shape), "dtype": c.dtype} for c in summary.columns],
            }
        )
        return
    table = Table(title="extracted" + (" (resumed)" if summary.resumed else ""), show_header=False, expand=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("to", escape(str(summary.out)))
    table.add_row("tokens", f"{summary.tokens:,} ({summary.rows:,} rows)")
    for column in summary.columns:
        table.add_row(escape(column.name), f"({', '.join(map(str, column.shape))}) {column.dtype}")
    table.add_row("shards", f"{summary.shards_written} written, {summary.shards_skipped} already there")
    print_wide(table)


def progress_view(shown: bool) -> RichProgressView | PlainProgressView | NoProgress:
    if not shown:
        return NoProgress()
    if console.is_terminal and not console.is_dumb_terminal:
        return RichProgressView()
    return PlainProgressView()


class NoProgress(PlainLines):
    def update(self, p: ExtractProgress) -> None:
        return None


class RichProgressView(LiveBar):
    """Tokens done of this process's share, tokens/s and MB written."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.bar = Progress(
            TextColumn("extracting"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self.task = self.bar.add_task("extracting", total=None, detail="")

    def update(self, p: ExtractProgress) -> None:
        self.bar.update(self.task, completed=p.tokens_done, total=p.tokens_total, detail=detail(p, self.start))


class PlainProgressView(PlainLines):
    def __init__(self) -> None:
        self.target, self.start = console, time.perf_counter()
        self.last_line = self.start

    def update(self, p: ExtractProgress) -> None:
        if self.due():
            self.say(f"extracting: {p.tokens_done:,} of {p.tokens_total:,} tokens, {detail(p, self.start)}")


def detail(p: ExtractProgress, start: float) -> str:
    rate = p.tokens_done / max(time.perf_counter() - start, 1e-9)
    return f"{p.tokens_done:,} tokens · {rate:,.0f} tok/s · {p.bytes_written / 1e6:,.1f} MB written"


@app.command("compare")
@user_errors
def compare(
    first: Path = typer.Argument(..., metavar="DIR_A", help="A forge extract output folder."),
    second: Path | None = typer.Argument(
        None, metavar="[DIR_B]", help="Another one over the same tokens \\[default: DIR_A against itself]."
    ),
    layers: list[str] = typer.Option(None, "--layers", "-l", help="Layer names or globs to compare \\[default: all]."),
    metric: str = typer.Option("cka", "--metric", "-m", help="cka, svcca or rsa."),
    unbiased: bool = typer.Option(False, "--unbiased", help="CKA with the unbiased HSIC estimator."),
    keep: float = typer.Option(0.99, "--keep", help="SVCCA: fraction of the variance the kept directions explain."),
    rsa_rows: int = typer.Option(2000, "--rsa-rows", help="RSA: rows (spread evenly) its dissimilarity matrices use."),
    plot: Path | None = typer.Option(
        None, "--plot", help="Write a layer × layer heatmap PNG (needs matplotlib: pip install 'forge-lm\\[plot]')."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the matrix as JSON."),
) -> None:
    """Layer × layer similarity of the activations of one or two extractions over the same tokens.

    Linear CKA and SVCCA are computed from sums accumulated batch by batch, so outputs larger than memory
    compare in bounded memory; RSA uses --rsa-rows rows.

    [bold]Examples[/bold]

      forge extract compare acts/debug --metric cka --plot cka.png

      forge extract compare acts/step100 acts/step200 --layers 'layers.*' --metric svcca

    """
    from engine.errors import UserError
    from engine.interp.similarity import compare as similarity

    if unbiased and metric != "cka":
        raise UserError("--unbiased applies to --metric cka only", "drop --unbiased, or use --metric cka")
    name = "cka_unbiased" if unbiased else metric
    result = similarity(first, second, split(layers), name, keep=keep, rsa_rows=rsa_rows)
    if plot is not None:
        heatmap(result, plot, first, second)
    if as_json:
        print_json(
            {
                "metric": result.metric,
                "rows": result.rows,
                "left": result.left,
                "right": result.right,
                "values": result.values.tolist(),
            }
        )
        return
    table = Table(title=f"{result.metric} over {result.rows:,} rows")
    table.add_column(escape(f"{first.name} \\ {(second or first).name}"), style="bold")
    for name_ in result.right:
        table.add_column(escape(name_), justify="right")
    for name_, row in zip(result.left, result.values):
        table.add_row(escape(name_), *(f"{v:.3f}" for v in row))
    print_wide(table)


def heatmap(result: Comparison, path: Path, first: Path, second: Path | None) -> None:
    from engine.errors import UserError

    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(
            "--plot needs matplotlib, which is not installed",
            "pip install 'forge-lm[plot]' (or pip install matplotlib)",
        ) from None
    size = max(4.0, 0.45 * max(len(result.left), len(result.right)) + 2)
    figure = Figure(figsize=(size + 1, size), layout="constrained")
    axes = figure.subplots()
    image = axes.imshow(result.values, cmap="viridis", vmin=0, vmax=1 if result.metric != "rsa" else None)
    axes.set_xticks(range(len(result.right)), result.right, rotation=90, fontsize="small")
    axes.set_yticks(range(len(result.left)), result.left, fontsize="small")
    axes.set_xlabel(str(second or first))
    axes.set_ylabel(str(first))
    axes.set_title(f"{result.metric} over {result.rows:,} rows")
    figure.colorbar(image, ax=axes)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
