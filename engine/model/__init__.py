"""The model: `build_model` is the one way Forge makes one from a `[model]` section.

It looks `model.model_type` up in the MODELS registry, as every other configured component is chosen, so a
new model variant registers itself and every builder (training, generation, conversion, benchmarks) gets it.
This package's import stays torch-free (validate-config reads `engine.model.estimate`): the model classes
are imported, and so registered, only when a model is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config.model import ModelConfig
from engine.config.registry import MODELS

if TYPE_CHECKING:
    from engine.model.transformer import Transformer


def build_model(cfg: ModelConfig) -> Transformer:
    """A freshly initialised model of `cfg` on the current default device (`with torch.device(...)`)."""
    import engine.model.transformer  # noqa: F401  (registers the model types)

    return MODELS.get(cfg.model_type)(cfg)
