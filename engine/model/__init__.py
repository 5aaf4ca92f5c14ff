"""The model: `build_model` is the one way Forge makes one from a `[model]` section.

It looks `model.model_type` up in the MODELS registry, where every model family registers its `ModelSpec`
(engine/model/spec.py, one folder per family under engine/model/families/), so every builder (training,
generation, conversion, benchmarks) gets a new family. This package's import stays torch-free (validate-config
reads the specs and `engine.model.estimate`): a family's torch module is imported only when a model is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config.model import ModelConfig
from engine.model import families  # noqa: F401  (registers the model families)
from engine.model.spec import spec_for

if TYPE_CHECKING:
    import torch
    from torch import nn


def build_model(cfg: ModelConfig) -> nn.Module:
    """A freshly initialised model of `cfg` on the current default device (`with torch.device(...)`)."""
    return spec_for(cfg).model_class()(cfg)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate a model (or a pipeline stage of one) built on the meta device on `device`, uninitialised, with
    its derived tables. `to_empty` gives every module a new tensor of its own, so a tied embedding and head
    held as plain tensors (a pipeline's last stage with multi-token prediction, without FSDP or TP, whose
    DTensor parameters stay shared) come out as two: they share the embedding's again."""
    model.to_empty(device=device)
    tied = spec_for(model.cfg).parts.tied
    if model.cfg.tie_embeddings and tied is not None:
        embedding, head = (getattr(model, name, None) for name in tied)
        if embedding is not None and head is not None and head.weight is not embedding.weight:
            head.weight = embedding.weight
    model.reset_rope_tables()
