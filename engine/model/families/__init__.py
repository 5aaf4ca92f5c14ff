"""Model families, one folder each; importing this registers every family's config class (its `[model]` fields,
`config.py`) and its `ModelSpec` in `MODELS`, torch-free (engine/config/model.py imports it to compose `[model]`).
A new family adds its folder and its line here."""

from engine.model.families import (
    gpt2,  # noqa: F401
    transformer,  # noqa: F401
)
