"""`forge generate`: sample text from a checkpoint, streamed to the terminal. The work is in `engine.generate`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from forgecli.ui import console, err_console, show_user_error, user_errors

if TYPE_CHECKING:  # the engine is imported when the command runs, not when `forge --help` loads the app
    import torch

    from engine.data.tokenizer import Encoder
    from engine.generate import Sampling
    from engine.model.transformer import Transformer


@user_errors
def generate(
    target: Path = typer.Argument(
        ...,
        metavar="RUN_DIR|CKPT",
        help=(
            "A run directory (its newest complete checkpoint), a checkpoint folder, one step_N folder, "
            "or a Hugging Face model folder."
        ),
    ),
    prompt: str = typer.Option("", "--prompt", "-p", help="Text to continue. Empty: start a new document."),
    max_new_tokens: int = typer.Option(
        200,
        "--max-new-tokens",
        "-n",
        help="Most tokens to generate (fewer if the "
        "model ends the document); prompt + these must fit in model.max_seq_len.",
    ),
    temperature: float = typer.Option(
        0.8, "--temperature", "-t", help="Softmax temperature; 0 = greedy (always the most likely token)."
    ),
    top_k: int = typer.Option(50, "--top-k", help="Sample among the k most likely tokens only; 0 = all."),
    top_p: float = typer.Option(
        1.0, "--top-p", help="Sample among the most likely tokens whose probability reaches p; 1 = all."
    ),
    seed: int | None = typer.Option(None, "--seed", help="Seed of the sampler: the same seed gives the same text."),
    interactive: bool = typer.Option(
        False, "--interactive", "-i", help="Ask for prompts in a loop (an empty line or Ctrl-D quits)."
    ),
    ema: bool = typer.Option(
        False, "--ema", help="Sample from the EMA of the weights the run kept (train.ema_decay) instead."
    ),
) -> None:
    """Generate text from a checkpoint with its run's tokenizer, streaming it as it is sampled.

    The model runs on one device (the GPU if there is one) with a KV cache. The prompt starts a new
    document, as in training; generation stops at the end-of-text token or after --max-new-tokens.

    [bold]Examples[/bold]

      forge generate runs/debug --prompt "ROMEO:" --seed 0

      forge generate runs/debug --temperature 0 --max-new-tokens 50 --prompt "To be, or not to be"

      forge generate runs/debug/checkpoints/step_150 --interactive

      forge generate runs/debug --ema --prompt "ROMEO:"

    """
    from engine.generate import Sampling, default_device, load_model

    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    device = default_device()
    model, encoder = load_model(target, device, ema=ema)
    if model.cfg.mtp_depth:  # on stderr, so that the sampled text on stdout stays just that
        err_console.print(
            f"model.mtp_depth = {model.cfg.mtp_depth}: sampling from the main model; the multi-token-prediction "
            "modules are left out",
            style="dim",
            markup=False,
        )
    generator = sampling.generator(device)
    if not interactive:
        stream(model, encoder, prompt, max_new_tokens, sampling, generator, echo=True)
        return
    from engine.errors import UserError

    while True:
        try:
            text = console.input("[bold]prompt>[/bold] ")
        except EOFError:
            break
        if not text:
            break
        try:
            stream(model, encoder, text, max_new_tokens, sampling, generator)
        except UserError as err:  # e.g. a prompt too long for the context: say so, ask for the next one
            show_user_error(err)


def stream(
    model: Transformer,
    encoder: Encoder,
    prompt: str,
    max_new_tokens: int,
    sampling: Sampling,
    generator: torch.Generator,
    echo: bool = False,
) -> None:
    """Write the continuation of `prompt` (after the prompt itself when `echo`) to stdout piece by piece."""
    from engine.generate import TextStream, check_lengths, prompt_ids
    from engine.generate import generate as sample

    ids = prompt_ids(encoder, prompt)
    check_lengths(model, len(ids), max_new_tokens)  # before anything is printed
    if echo:
        sys.stdout.write(prompt)
    text = TextStream(encoder.tokenizer, ids)
    for token in sample(model, ids, max_new_tokens, sampling, stop_ids=[encoder.eos_id], generator=generator):
        sys.stdout.write(text.add(token))
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
