"""The `forge` Typer application. Each command lives in its own module; none imports torch at import time."""

from __future__ import annotations

import typer

from forgecli import convert, doctor, generate, resume, tokenize, train, validate_config

app = typer.Typer(
    name="forge",
    help="Pretrain dense and mixture-of-experts language models, from one CPU to many GPU nodes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode="rich",
)

EXTRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}

app.command("train", context_settings=EXTRA_ARGS)(train.train)
app.command("resume", context_settings=EXTRA_ARGS)(resume.resume)
app.command("validate-config", context_settings=EXTRA_ARGS)(validate_config.validate_config)
app.command("tokenize")(tokenize.tokenize)
app.command("doctor")(doctor.doctor)
app.add_typer(convert.app, name="convert")
app.command("generate")(generate.generate)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
