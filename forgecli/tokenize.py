"""`forge tokenize`: text / JSONL / Parquet or a Hugging Face dataset → token shards + manifest. The work is in
`engine.data.tokenize`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table
from typer.core import TyperCommand

from engine.data import DEFAULT_SHARD_TOKENS
from forgecli.ui import LiveBar, PlainLines, console, err_console, print_json, print_wide, user_errors

if TYPE_CHECKING:  # the engine is imported when the command runs, not when `forge --help` loads the app
    from engine.data.tokenize import Progress as TokenizeProgress
    from engine.data.tokenize import TokenizeReport


@user_errors
def tokenize(
    inputs: list[str] = typer.Argument(
        ...,
        metavar="INPUT",
        show_default=False,
        help=(
            ".txt files (one document each), .jsonl files (one document per line), .parquet files (one per row), "
            "or directories searched recursively for them; or such files and folders as URLs (s3://, gs://, https://, "
            "streamed; credentials from the store's usual environment); or one Hugging Face dataset as hf:NAME (a Hub "
            "id, a local folder of data files, or a save_to_disk folder), one document per row."
        ),
    ),
    out: Path = typer.Option(
        ..., "--out", "-o", help="Output directory: shard-NNNNN.npy, manifest.json, tokenizer.json."
    ),
    tokenizer: Path | None = typer.Option(None, "--tokenizer", help="A Hugging Face tokenizer.json to encode with."),
    train_tokenizer: bool = typer.Option(
        False, "--train-tokenizer", help="Train a byte-level BPE on the inputs instead (needs --vocab-size)."
    ),
    vocab_size: int | None = typer.Option(None, "--vocab-size", help="Vocabulary size for --train-tokenizer."),
    eos_token: str | None = typer.Option(
        None,
        "--eos-token",
        help=(
            "Token appended after every document. Default: <|endoftext|> when training; for --tokenizer, the eos_token "
            "of a tokenizer_config.json beside it, else a well-known end-of-text token in its vocabulary."
        ),
    ),
    text_field: str = typer.Option(
        "text", "--text-field", help="JSONL field / Parquet or dataset column that holds the text."
    ),
    shard_tokens: int = typer.Option(
        DEFAULT_SHARD_TOKENS, "--shard-tokens", help="Tokens per shard (the last one holds the rest)."
    ),
    hf_config: str | None = typer.Option(
        None, "--hf-config", help="hf:NAME only: the dataset's configuration (subset)."
    ),
    split: str | None = typer.Option(
        None, "--split", help=("hf:NAME only: the split to tokenize. Default: train (a save_to_disk Dataset: its own).")
    ),
    streaming: bool = typer.Option(
        False,
        "--streaming",
        help=("hf:NAME only: read rows as they are tokenized instead of downloading the split first."),
    ),
    revision: str | None = typer.Option(None, "--revision", help="hf:NAME only: a Hub branch, tag or commit."),
    num_shards: int | None = typer.Option(
        None,
        "--num-shards",
        help="Tokenize only part --shard-index of this many (for many machines; join them with forge tokenize merge).",
    ),
    shard_index: int | None = typer.Option(None, "--shard-index", help="Which part, from 0 (with --num-shards)."),
    as_json: bool = typer.Option(
        False, "--json", help="Print the result (manifest included) as JSON; progress goes to stderr."
    ),
) -> None:
    """Tokenize text into memory-mapped token shards for `forge train` (data.dataset_path = OUT).

    Uses every core. An interrupted run resumes where it stopped when rerun with the same inputs and options.

    [bold]Examples[/bold]

      forge tokenize corpus/ --train-tokenizer --vocab-size 32000 --out data/mycorpus

      forge tokenize train.jsonl --tokenizer tokenizer.json --text-field content --out data/train

      forge tokenize part-*.parquet --tokenizer tokenizer.json --shard-tokens 100000000 --out data/web

      forge tokenize hf:HuggingFaceFW/fineweb-edu --hf-config sample-10BT --streaming --tokenizer tok.json --out data/fw

      forge tokenize corpus/ --tokenizer tok.json --num-shards 8 --shard-index 3 --out data/parts/part-00003

      forge tokenize merge data/parts/part-* --out data/corpus   (joins the parts into one data set)

      forge tokenize s3://my-bucket/corpus/ --tokenizer tok.json --out data/corpus

    """
    from engine.data.parts import part_of
    from engine.data.sources import skipped_under
    from engine.data.tokenize import check_request, open_source
    from engine.data.tokenize import tokenize as tokenize_source

    train_vocab_size = trained_vocab_size(train_tokenizer, vocab_size)
    part = part_of(num_shards, shard_index)
    check_request(out, tokenizer, train_vocab_size, eos_token, shard_tokens, part)  # before a dataset downloads
    source = open_source(inputs, hf_config, split, streaming, revision)
    say_skipped(skipped_under(inputs), err_console if as_json else console)
    view = progress_view(err_console if as_json else console)
    with view:
        report = tokenize_source(
            source,
            out,
            tokenizer=tokenizer,
            train_vocab_size=train_vocab_size,
            eos_token=eos_token,
            text_field=text_field,
            shard_tokens=shard_tokens,
            progress=view.update,
            part=part,
        )
    if as_json:
        print_json(report_json(report))
    else:
        print_wide(summary_table(report))


@user_errors
def merge(
    parts: list[Path] = typer.Argument(
        ..., metavar="PART_DIR", show_default=False, help="The parts' output directories, in any order."
    ),
    out: Path = typer.Option(..., "--out", "-o", help="New (or empty) directory for the joined data set."),
    as_json: bool = typer.Option(False, "--json", help="Print the result (manifest included) as JSON."),
) -> None:
    """Join the parts of a `forge tokenize --num-shards N` run into one data set with one manifest.

    Every part must be finished and of the same run (inputs, options, tokenizer); each index once, none missing.
    Shards are hard-linked where the file system allows (else copied) and renumbered in part order.

    [bold]Examples[/bold]

      forge tokenize merge data/parts/part-* --out data/corpus
    """
    from engine.data.parts import merge_parts

    report = merge_parts(parts, out)
    m = report.manifest
    if as_json:
        print_json(
            {
                "directory": str(report.directory),
                "already_complete": report.already_complete,
                "parts": report.parts,
                "linked": report.linked,
                "manifest": m.to_json(),
            }
        )
        return
    title = "already merged (nothing to do)" if report.already_complete else "merged"
    table = Table(title=title, show_header=False, expand=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("directory", escape(str(report.directory)))
    table.add_row("parts", f"{report.parts}")
    table.add_row("tokens", f"{m.total_tokens:,}")
    table.add_row("documents", f"{m.total_documents:,}")
    how = "" if report.already_complete else (" (hard links)" if report.linked else " (copied)")
    table.add_row("shards", f"{len(m.shards)} × {m.dtype}{how}")
    print_wide(table)


def trained_vocab_size(train_tokenizer: bool, vocab_size: int | None) -> int | None:
    """--train-tokenizer and --vocab-size come together; --tokenizer vs training is checked by the engine."""
    from engine.errors import DataError

    if train_tokenizer and vocab_size is None:
        raise DataError("--train-tokenizer needs --vocab-size N", "e.g. --train-tokenizer --vocab-size 32000")
    if vocab_size is not None and not train_tokenizer:
        raise DataError(
            "--vocab-size only applies with --train-tokenizer",
            "add --train-tokenizer, or drop --vocab-size to keep the vocabulary of --tokenizer",
        )
    return vocab_size


def progress_view(target: Console) -> RichProgressView | PlainProgressView:
    return RichProgressView(target) if target.is_terminal and not target.is_dumb_terminal else PlainProgressView(target)


class RichProgressView(LiveBar):
    """A live bar over the input (bytes, or rows of a dataset), with tokens and throughput; one task per phase.
    A stream of unknown length shows a moving bar."""

    def __init__(self, target: Console) -> None:
        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeRemainingColumn(),
            console=target,
        )
        self.tasks: dict[str, int] = {}
        self.started = self.last = time.perf_counter()

    def update(self, p: TokenizeProgress) -> None:
        if p.phase not in self.tasks:
            for task in self.tasks.values():  # the earlier phase is over, however long its stream was
                done = self.bar.tasks[task].total or self.bar.tasks[task].completed
                self.bar.update(task, total=done, completed=done)
            self.tasks[p.phase] = self.bar.add_task(p.phase, total=p.total, detail="")
            self.started = self.last  # the phase began when the previous one reported last
        self.last = time.perf_counter()
        rows = f"{p.done:,} rows read, " if p.total is None else ""  # the bar shows no count without a total
        self.bar.update(self.tasks[p.phase], completed=p.done, detail=rows + detail(p, self.last - self.started))


class PlainProgressView(PlainLines):
    """Plain lines for logs: one when a phase starts or a shard is written, else one every 10 s."""

    def __init__(self, target: Console) -> None:
        self.target = target
        self.started = self.last_event = self.last_line = time.perf_counter()
        self.phase, self.shards = "", 0

    def update(self, p: TokenizeProgress) -> None:
        now = time.perf_counter()
        quiet = p.phase == self.phase and p.shards == self.shards and not self.due()
        if p.phase != self.phase:
            self.phase, self.started = p.phase, self.last_event  # the phase began when the previous one reported last
        self.last_event = now
        if quiet:
            return
        self.shards = p.shards
        self.say(f"{p.phase}: {amount(p)}, {detail(p, now - self.started)}")


def amount(p: TokenizeProgress) -> str:
    """How much of the input is read: a share of its size, or a count of rows for a stream of unknown length."""
    if p.total is None:
        return f"{p.done:,} rows read"
    size = f"{p.total / 1e6:,.1f} MB" if p.unit == "bytes" else f"{p.total:,} rows"
    return f"{100 * p.done / max(p.total, 1):.0f}% of {size}"


def detail(p: TokenizeProgress, seconds: float) -> str:
    if p.phase != "tokenizing":
        return f"{p.documents:,} documents"
    rate = f", {p.tokens / seconds / 1e6:.2f} M tok/s" if seconds > 0 else ""
    return f"{p.tokens:,} tokens, {p.documents:,} documents, {p.shards} shards{rate}"


def new_tokens(report: TokenizeReport) -> int:
    """Tokens encoded by this run (finished shards reused from an interrupted run are not counted)."""
    return report.manifest.total_tokens - sum(s.tokens for s in report.manifest.shards[: report.reused_shards])


def report_json(report: TokenizeReport) -> dict:
    return {
        "directory": str(report.directory),
        "already_complete": report.already_complete,
        "reused_shards": report.reused_shards,
        "seconds": round(report.seconds, 3),
        "tokens_per_second": round(new_tokens(report) / report.seconds) if report.seconds > 0 else None,
        "manifest": report.manifest.to_json(),
    }


def summary_table(report: TokenizeReport) -> Table:
    m = report.manifest
    title = "already tokenized (nothing to do)" if report.already_complete else "tokenized"
    table = Table(title=title, show_header=False, expand=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("directory", escape(str(report.directory)))
    table.add_row("tokens", f"{m.total_tokens:,}")
    table.add_row("documents", f"{m.total_documents:,}")
    table.add_row(
        "shards",
        f"{len(m.shards)} × {m.dtype}"
        + (
            f" ({report.reused_shards} reused from an interrupted run)"
            if report.reused_shards and not report.already_complete
            else ""
        ),
    )
    table.add_row(
        "tokenizer",
        escape(f"vocab {m.vocab_size:,}, eos {m.eos_token!r} = {m.eos_id}, sha256 {m.tokenizer_sha256[:16]}…"),
    )
    if not report.already_complete:
        table.add_row(
            "time", f"{report.seconds:.1f} s, {new_tokens(report) / max(report.seconds, 1e-9) / 1e6:.2f} M tokens/s"
        )
    return table


class WithMerge(TyperCommand):
    """`forge tokenize`, which hands `forge tokenize merge …` to `merge`: a command whose arguments are input
    paths cannot also be a group of subcommands (an input file named merge is still `./merge`)."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra
    ) -> click.Context:
        if args[:1] == ["merge"]:
            merger = typer.Typer(rich_markup_mode="rich", add_completion=False)
            merger.command("merge")(merge)
            command = typer.main.get_command(merger)
            return command.make_context(f"{info_name} merge", args[1:], parent=parent, **extra)
        return super().make_context(info_name, args, parent=parent, **extra)


def say_skipped(files: list[Path], to: Console) -> None:
    """One note for the files of the input folders that are not read (their extension is not one forge
    tokenize reads), naming the first few."""
    if files:
        names = ", ".join(str(f) for f in files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
        to.print(
            f"[yellow]note:[/yellow] skipped {len(files)} file(s) that are not .txt, .jsonl or .parquet: "
            f"{escape(names)} (rename a text file to .txt to include it)",
            soft_wrap=True,
        )
