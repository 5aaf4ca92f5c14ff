"""`forge convert`: Forge checkpoints ↔ Hugging Face model folders. The work is in `engine.checkpoint.hf`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table

from forgecli.ui import LiveBar, PlainLines, console, err_console, print_json, print_wide, user_errors

if TYPE_CHECKING:  # the engine is imported when a command runs, not when `forge --help` loads the app
    from engine.checkpoint.hf import ConvertProgress, ConvertReport


app = typer.Typer(
    name="convert",
    help="Convert checkpoints: Forge → Hugging Face (to-hf) and Hugging Face → Forge (from-hf).",
    no_args_is_help=True,
    rich_markup_mode="rich",
)


@app.command("to-hf")
@user_errors
def to_hf(
    source: Path = typer.Argument(
        ...,
        metavar="RUN_DIR|CKPT",
        help=("A run directory (its newest complete checkpoint), a checkpoint folder, or one step_N folder."),
    ),
    out: Path = typer.Option(..., "--out", "-o", help="The Hugging Face model folder to write; must not exist yet."),
    dtype: str | None = typer.Option(
        None,
        "--dtype",
        help="Weight dtype of the export: float32, bfloat16 or float16. Default: the run's checkpoint.export_dtype "
        "(float32 unless its preset says otherwise).",
        show_default=False,
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON; progress goes to stderr."),
    ema: bool = typer.Option(
        False, "--ema", help="Export the EMA of the weights the run kept (train.ema_decay) instead of the weights."
    ),
    merge: bool = typer.Option(
        False, "--merge", help="A \\[lora] run: write one plain model, each adapter added into its base weight."
    ),
    adapters_only: bool = typer.Option(
        False,
        "--adapters-only",
        help="A \\[lora] run: write only its adapters, as a peft adapter folder (adapter_config.json + "
        "adapter_model.safetensors) for the base model exported from the run's checkpoint.load_path.",
    ),
) -> None:
    """Export a Forge checkpoint as a Hugging Face `transformers` model folder.

    Writes config.json, model.safetensors (sharded with an index above 5 GB), generation_config.json
    and the run's tokenizer, so that AutoModelForCausalLM / AutoTokenizer.from_pretrained(OUT) work
    offline. Dense models become LlamaForCausalLM (Qwen3ForCausalLM with qk_norm); MoE models
    Qwen2MoeForCausalLM / Qwen3MoeForCausalLM (softmax routers, without / with qk_norm),
    MixtralForCausalLM (softmax_topk_renorm, every block MoE) or Glm4MoeForCausalLM (sigmoid_topk router,
    group-limited or not). A model no transformers class computes exactly is
    refused with the field that prevents it. A checkpoint saved under any parallel layout converts the
    same way. Nothing is written unless the whole export succeeds.

    [bold]Examples[/bold]

      forge convert to-hf runs/debug --out exports/debug-hf

      forge convert to-hf runs/big/checkpoints/step_20000 --out exports/big-hf --dtype bfloat16

      forge convert to-hf runs/big --out exports/big-ema-hf --ema

      forge convert to-hf runs/lora --out exports/lora-adapter --adapters-only

      forge convert to-hf runs/lora --out exports/lora-merged --merge

    """
    from engine.checkpoint.hf import export_to_hf
    from engine.checkpoint.hf_lora import export_adapters
    from engine.errors import UserError

    if adapters_only and (merge or ema):
        raise UserError("--adapters-only writes the adapters alone", "leave out --merge and --ema")
    with progress_view(err_console if as_json else console, "exporting") as view:
        if adapters_only:
            report = export_adapters(source, out, dtype=dtype, progress=view.update)
        else:
            report = export_to_hf(source, out, dtype=dtype, progress=view.update, ema=ema, merge=merge)
    show(report, as_json, "exported to Hugging Face")


@app.command("from-hf")
@user_errors
def from_hf(
    hf_dir: Path = typer.Argument(
        ...,
        metavar="HF_DIR",
        help=("A local Hugging Face Llama, Qwen3, Qwen2-MoE, Qwen3-MoE or GLM-4-MoE model folder."),
    ),
    out: Path = typer.Option(..., "--out", "-o", help="The Forge checkpoint folder to write; must not exist yet."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON; progress goes to stderr."),
    adapter: Path | None = typer.Option(
        None,
        "--adapter",
        help="A peft LoRA adapter folder trained on HF_DIR (adapter_config.json + adapter_model.safetensors): "
        "imported merged into the weights.",
    ),
) -> None:
    """Import a Hugging Face Llama/Qwen3 (or Qwen2-MoE/Qwen3-MoE/GLM-4-MoE) model folder as a Forge checkpoint.

    OUT gets step_0/ (the weights in DCP format), latest, model.toml (the \\[model] section that matches
    the weights: copy it into your preset) and the folder's tokenizer.json. Models Forge cannot
    reproduce exactly (other architectures, biases, RoPE scaling, sliding windows, other MoE routing)
    are refused.

    [bold]Examples[/bold]

      forge convert from-hf ~/models/TinyLlama-1.1B --out checkpoints/tinyllama

      forge generate checkpoints/tinyllama --prompt "Once upon a time"

      forge convert from-hf ~/models/TinyLlama-1.1B --adapter ~/adapters/tinyllama-chat --out checkpoints/chat

    """
    from engine.checkpoint.hf import import_from_hf, model_toml
    from engine.checkpoint.hf_lora import import_with_adapter

    with progress_view(err_console if as_json else console, "importing") as view:
        if adapter is None:
            report = import_from_hf(hf_dir, out, progress=view.update)
        else:
            report = import_with_adapter(hf_dir, adapter, out, progress=view.update)
    show(report, as_json, "imported from Hugging Face")
    if not as_json:
        console.print(f"\n{out / 'model.toml'}:", markup=False, highlight=False, soft_wrap=True)
        console.print(model_toml(report.model), markup=False, highlight=False, soft_wrap=True)


def show(report: ConvertReport, as_json: bool, title: str) -> None:
    if as_json:
        print_json(
            {
                "source": str(report.source),
                "out": str(report.out),
                "architecture": report.architecture,
                "parameters": report.parameters,
                "bytes": report.bytes,
                "files": report.files,
                "left_out": report.left_out,
                "model": report.model.model_dump(mode="json", exclude_none=True),
            }
        )
        return
    table = Table(title=title, show_header=False, expand=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("from", escape(str(report.source)))
    table.add_row("to", escape(str(report.out)))
    table.add_row("architecture", report.architecture)
    table.add_row("parameters", f"{report.parameters:,} ({report.bytes / 1e6:,.1f} MB)")
    table.add_row("files", escape(", ".join(report.files)))
    for what in report.left_out:
        table.add_row("left out", escape(what))
    print_wide(table)


def progress_view(target: Console, what: str) -> RichProgressView | PlainProgressView:
    if target.is_terminal and not target.is_dumb_terminal:
        return RichProgressView(target, what)
    return PlainProgressView(target, what)


class RichProgressView(LiveBar):
    """A live bar over the parameters converted so far."""

    def __init__(self, target: Console, what: str) -> None:
        self.bar = Progress(
            TextColumn(what),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[tensor]}"),
            TimeRemainingColumn(),
            console=target,
            transient=True,
        )
        self.task = self.bar.add_task(what, total=None, tensor="")

    def update(self, p: ConvertProgress) -> None:
        self.bar.update(self.task, completed=p.done, total=p.total, tensor=escape(p.tensor))


class PlainProgressView(PlainLines):
    """For logs: one line every 10 s, none for a conversion quicker than that."""

    def __init__(self, target: Console, what: str) -> None:
        self.target, self.what = target, what
        self.last_line = time.perf_counter()

    def update(self, p: ConvertProgress) -> None:
        if self.due():
            self.say(f"{self.what}: {100 * p.done / max(p.total, 1):.0f}% of {p.total:,} parameters")
