"""`forge init`: write a commented preset from a few questions (or none: --defaults, --from), then show it
checked like `forge validate-config` does. The document itself is built by `engine.plan.writer`."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.prompt import Confirm, IntPrompt, Prompt

from forgecli.completion import complete_preset
from forgecli.ui import console, print_wide, user_errors

if TYPE_CHECKING:
    from engine.plan.writer import InitAnswers, WrittenPreset

CUSTOM = "custom"
DATA_CHOICES = {
    "embedded": "the embedded Shakespeare corpus (no download)",
    "shards": "a directory of token shards written by forge tokenize",
    "hf": "a Hugging Face dataset, tokenized on first use with a tokenizer you name",
}


@user_errors
def init(
    preset: Path = typer.Argument(
        Path("forge.toml"), help="Where to write the preset.", autocompletion=complete_preset
    ),
    defaults: bool = typer.Option(
        False,
        "--defaults",
        help="Ask nothing: the debug preset's model (or the first preset found, or the built-in defaults) on the "
        "embedded corpus, one process.",
    ),
    base: Path | None = typer.Option(
        None,
        "--from",
        exists=True,
        dir_okay=False,
        autocompletion=complete_preset,
        help="Ask nothing: a commented copy of this preset.",
    ),
    force: bool = typer.Option(
        False, "--force", help="Overwrite the file if it exists (a regular file only: never a device or a link)."
    ),
) -> None:
    """Write a commented preset from a few questions and check it like validate-config.

    Asks for the model size (a preset's, or your own dimensions), dense or MoE, the data, GPUs and nodes,
    precision, optimizer, and steps or a token budget. Comments in the file say what each field does and
    which values were derived from the answers.

    [bold]Examples[/bold]

      forge init my_run.toml

      forge init my_run.toml --defaults

      forge init debug_commented.toml --from presets/debug.toml --force

    """
    from engine.durable import check_writable, write_durably
    from engine.errors import UserError
    from engine.plan.writer import answers_from, build_preset, default_preset

    check_writable(preset, "PRESET")  # --force replaces a regular file only, never a device or a link
    if preset.exists() and not force:
        raise UserError(f"{preset} already exists", "pass --force to overwrite it, or name another file")
    if not (defaults or base) and not stdin_is_terminal():
        raise UserError(
            "forge init asks questions, but its input is not a terminal", "in scripts, use --defaults or --from PRESET"
        )
    presets = preset_choices()
    if base is not None:
        answers = answers_from(base)
    elif defaults:
        answers = answers_from(presets.get(default_preset(presets) or ""))
    else:
        answers = ask(presets)
    written = build_preset(answers, str(preset))
    preset.parent.mkdir(parents=True, exist_ok=True)
    write_durably(preset, written.text)
    show(preset, written)


def stdin_is_terminal() -> bool:
    """Prompts need someone to answer them: without a terminal they would wait forever or read garbage."""
    return sys.stdin.isatty()


def preset_choices() -> dict[str, Path]:
    """Presets to take a model size from: ./presets, then the presets shipped beside the engine."""
    import engine
    from engine.plan.writer import find_presets

    return find_presets([Path("presets"), Path(engine.__file__).resolve().parents[1] / "presets"])


def ask(presets: dict[str, Path]) -> InitAnswers:
    """The questions, each with the answer of the chosen base preset as its default."""
    from engine.plan.writer import answers_from, default_preset

    console.print("[bold]forge init[/bold]: a few questions; Enter takes the default in brackets.")
    size = Prompt.ask(
        "Model size (a preset's model, or custom dimensions)",
        console=console,
        choices=[*presets, CUSTOM],
        default=default_preset(presets) or CUSTOM,
    )
    answers = answers_from(presets.get(size) or presets.get(default_preset(presets) or ""))  # custom: sized anew
    if size == CUSTOM:
        dims = (
            IntPrompt.ask("  hidden size (dim)", console=console, default=256),
            IntPrompt.ask("  transformer blocks (n_layers)", console=console, default=4),
            IntPrompt.ask("  attention heads (n_heads, dividing dim)", console=console, default=4),
        )
        answers = replace(answers, dims=dims)
    answers = replace(answers, moe=Confirm.ask("Mixture of experts?", console=console, default=answers.moe))
    answers = ask_data(answers)
    answers = replace(
        answers,
        gpus_per_node=positive("GPUs per node (1 on a CPU)", answers.gpus_per_node),
        nodes=positive("Nodes", answers.nodes),
    )
    answers = replace(
        answers,
        precision=Prompt.ask(
            "Precision (auto = bf16 where the GPU has it, else fp32)",
            console=console,
            choices=["auto", "bf16", "fp16", "fp32", "fp8"],
            default=answers.precision,
        ),
    )
    answers = replace(
        answers,
        optimizer=Prompt.ask(
            "Optimizer",
            console=console,
            default=answers.optimizer,
            choices=["adamw", "lion", "muon", "schedule_free_adamw"],
        ),
    )
    return ask_budget(answers)


def ask_data(answers: InitAnswers) -> InitAnswers:
    for kind, what in DATA_CHOICES.items():
        console.print(f"  [cyan]{kind}[/cyan]: {what}")
    kind = Prompt.ask("Training data", console=console, choices=list(DATA_CHOICES), default=answers.data)
    if kind == "shards":
        return replace(answers, data=kind, dataset_path=required("  shard directory", answers.dataset_path))
    if kind == "hf":
        return replace(
            answers,
            data=kind,
            hf_dataset_name=required("  dataset (Hub id or local folder)", answers.hf_dataset_name),
            tokenizer_path=required("  tokenizer.json", answers.tokenizer_path),
        )
    return replace(answers, data=kind)


def required(question: str, default: str | None) -> str:
    while True:
        value = (
            Prompt.ask(question, console=console, default=default) if default else Prompt.ask(question, console=console)
        )
        if value.strip():
            return value.strip()
        console.print("[red]an answer is needed here[/red]")


def positive(question: str, default: int) -> int:
    while True:
        value = IntPrompt.ask(question, console=console, default=default)
        if value >= 1:
            return value
        console.print("[red]must be at least 1[/red]")


def ask_budget(answers: InitAnswers) -> InitAnswers:
    """Steps, or tokens with a unit; asked again until it parses."""
    from engine.plan.writer import with_budget

    while True:
        budget = Prompt.ask(
            "Train for how long (steps, or tokens: 50M, 2B)", console=console, default=str(answers.max_steps)
        )
        try:
            return with_budget(answers, budget)
        except ValueError:
            console.print(f"[red]{budget!r} is neither a number of steps nor a token budget like 50M[/red]")


def show(path: Path, written: WrittenPreset) -> None:
    """What validate-config shows for the written preset: size and cost, memory per rank."""
    from engine.plan.summary import job_summary
    from forgecli.validate_config import memory_table, summary_table

    cfg, world = written.job.config, written.world_size
    console.print(summary_table(job_summary(written.job)))
    print_wide(memory_table(written.job.memory, cfg, world, None))
    for key, why in written.derived.items():
        console.print(f"  [dim]derived[/dim] {key}: {why}", highlight=False)
    console.print(f"[green]✓ wrote {path}[/green], valid" + (f" for world size {world}" if world > 1 else ""))
