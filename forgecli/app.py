"""The `forge` Typer application. Each command lives in its own module; none imports torch at import time."""

from __future__ import annotations

import sys

import typer

from forgecli import (
    checkpoint,
    convert,
    doctor,
    extract,
    generate,
    init,
    resume,
    runs,
    scale,
    slurm,
    tokenize,
    train,
    validate_config,
)
from forgecli import eval as eval_cli
from forgecli.completion import OverrideCommand

app = typer.Typer(
    name="forge",
    help="Pretrain dense and mixture-of-experts language models, from one CPU to many GPU nodes.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    rich_markup_mode="rich",
)

EXTRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}

app.command("train", cls=OverrideCommand, context_settings=EXTRA_ARGS)(train.train)
app.command("resume", cls=OverrideCommand, context_settings=EXTRA_ARGS)(resume.resume)
app.command("validate-config", cls=OverrideCommand, context_settings=EXTRA_ARGS)(validate_config.validate_config)
app.command("tokenize", cls=tokenize.WithMerge)(tokenize.tokenize)
app.command("doctor")(doctor.doctor)
app.add_typer(convert.app, name="convert")
app.add_typer(checkpoint.app, name="checkpoint")
app.command("generate")(generate.generate)
app.command("eval")(eval_cli.eval_command)
app.command("init")(init.init)
app.add_typer(runs.app, name="runs")
app.add_typer(slurm.app, name="slurm")
app.add_typer(extract.app, name="extract")
app.add_typer(scale.app, name="scale")


def main() -> None:
    """Console-script entry point. A process of a multi-process run ends through the engine's `end_process`
    (its exit code kept, a traceback still printed), so no rank aborts in teardown after its work is done."""
    try:
        app()
    except BaseException as ended:
        launch = sys.modules.get("engine.parallel.launch")  # not imported: this process joined no group
        if launch is None or not launch.joined_process_group():
            raise
        launch.end_process(exit_code(ended))


def exit_code(ended: BaseException) -> int:
    """The code the interpreter would exit with, printing what it would print."""
    if isinstance(ended, SystemExit):
        if ended.code is None or isinstance(ended.code, int):
            return ended.code or 0
        print(ended.code, file=sys.stderr)
        return 1
    sys.excepthook(type(ended), ended, ended.__traceback__)
    return 130 if isinstance(ended, KeyboardInterrupt) else 1


if __name__ == "__main__":
    main()
