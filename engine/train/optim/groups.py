"""Which parameters decay, and which ones Muon orthogonalizes: decided by shape and place in the model."""

from __future__ import annotations

from torch import nn

from engine.model.lora import clean_name, is_adapter_weight
from engine.model.mup import mup_plan
from engine.model.spec import spec_for


def param_groups(model: nn.Module, weight_decay: float, exclude: frozenset[int] = frozenset()) -> list[dict]:
    """Two groups: ≥2-D weights other than embeddings decay; norms, biases and embedding tables do not.

    A tied output head (the family's `ModelParts.head`) shares the embedding's parameter and so follows the
    embedding (no decay), also where it is a copy of its own (the last pipeline stage's, whose model `cfg` says
    it is tied).
    Parameters whose id is in `exclude` (those another group of the optimizer owns) are left out.
    Under μP each of the two is split further by the parameters' learning-rate multipliers
    (`mup_lr_groups`).
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    cfg = getattr(model, "cfg", None)  # a model of a family (a bare module in some optimizer tests)
    head = getattr(model, spec_for(cfg).parts.head, None) if cfg is not None else None
    if cfg is not None and cfg.tie_embeddings and head is not None:
        embeddings.add(id(head.weight))
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad or id(param) in exclude:
            continue
        (decay if param.ndim >= 2 and id(param) not in embeddings else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return groups if cfg is None or cfg.parametrization != "mup" else mup_lr_groups(model, groups)


def mup_lr_groups(model: nn.Module, groups: list[dict], rule: str = "lr") -> list[dict]:
    """Each group split by μP's learning-rate multiplier (engine/model/mup.py: the `ParamScale` field `rule`,
    "lr" for entrywise updates, "muon_lr" for Muon's orthogonalized ones), which the group carries as
    `lr_multiplier`; `apply_lr_multipliers` turns it into the group's lr once the optimizer exists. Groups
    keep the order of their first parameter, so the first is usually the hidden matrices' (lr below the base:
    `current_lr` divides by the multiplier to report the base lr). LoRA adapters
    (width × rank) keep the base lr, like every tensor with one width-sized dimension."""
    plan = mup_plan(model.cfg)
    multiplier = {}
    for raw_name, param in model.named_parameters():
        name = clean_name(raw_name)
        multiplier[id(param)] = 1.0 if is_adapter_weight(name) else getattr(plan.params[name], rule)
    split = []
    for group in groups:
        by_lr: dict[float, list[nn.Parameter]] = {}
        for param in group["params"]:
            by_lr.setdefault(multiplier[id(param)], []).append(param)
        split += [{**group, "params": params, "lr_multiplier": lr} for lr, params in by_lr.items()]
    return split


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The 2-D weights inside the family's blocks (attention and MLP projections), whatever wraps the
    blocks (`ModelParts.is_hidden_matrix`). Embeddings, the output head, norms and biases are not hidden
    matrices."""
    parts = spec_for(model.cfg).parts
    return [p for name, p in model.named_parameters() if p.requires_grad and parts.is_hidden_matrix(name, p.ndim)]
