"""Model families, one folder each; importing this registers every family's `ModelSpec` in `MODELS`
(torch-free). A new family adds its folder and its line here."""

from engine.model.families import (
    gpt2,  # noqa: F401
    transformer,  # noqa: F401
)
