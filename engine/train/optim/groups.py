"""Which parameters decay, and which ones Muon orthogonalizes: decided by shape and place in the model."""

from __future__ import annotations

from torch import nn


def param_groups(model: nn.Module, weight_decay: float, exclude: frozenset[int] = frozenset()) -> list[dict]:
    """Two groups: ≥2-D weights other than embeddings decay; norms, biases and embedding tables do not.

    A tied output head shares the embedding's parameter and so follows the embedding (no decay), also where
    it is a copy of its own (the last pipeline stage's, whose model `cfg` says it is tied).
    Parameters whose id is in `exclude` (those another group of the optimizer owns) are left out.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    cfg, head = getattr(model, "cfg", None), getattr(model, "output", None)
    if cfg is not None and cfg.tie_embeddings and head is not None:
        embeddings.add(id(head.weight))
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad or id(param) in exclude:
            continue
        (decay if param.ndim >= 2 and id(param) not in embeddings else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The 2-D weights inside the transformer blocks (attention and MLP projections), whatever wraps the
    blocks (activation checkpointing, compile and FSDP keep the `layers.` prefix). Embeddings, the output
    head, norms and biases are not hidden matrices."""
    return [p for name, p in model.named_parameters() if p.requires_grad and p.ndim == 2 and name.startswith("layers.")]
