"""The routing metrics of a model with experts, from what its last forward kept: each expert layer's row
(`moe/{layer}/…`, the layer's own `metrics(stats, window)`) and the totals over all layers.

They read the model through its contract (engine/model/spec.py: `LanguageModel`'s `moe_layers()` and
`last_moe_stats`), not through engine/model/moe.py's classes, so the trainer and the pipeline
(engine/parallel/pipeline_moe.py) report any family's experts the same way.
"""

from __future__ import annotations

import torch
from torch import nn


def moe_metrics(model: nn.Module, windows: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    """Flat metrics of the routing of `model`'s last forward: each MoE layer's row (`moe/{layer}/…`) and the
    totals over all layers (`with_moe_totals`); {} for a dense model. `model` keeps the contract's
    `moe_layers()` and `last_moe_stats`; `windows`: layer name → tokens per expert summed since the last
    report (engine/train/moe_load.py), for the dead-expert counts. One host sync for all of them."""
    return with_moe_totals(moe_layer_metrics(model, windows))


def moe_layer_metrics(model: nn.Module, windows: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    """Each MoE layer's row of `model`'s last forward (`moe/{layer}/…`), in one host sync; {} when dense. A
    pipeline stage reports its own layers, and the rows of all stages together are one process's
    (engine/parallel/pipeline_moe.py)."""
    if not model.last_moe_stats:
        return {}
    layers, windows = model.moe_layers(), windows or {}
    keys, values = [], []
    for name, stats in model.last_moe_stats.items():
        row = layers[name].metrics(stats, windows.get(name))
        keys += [f"moe/{name}/{key}" for key in row]
        values += [v.detach().float().reshape(()) for v in row.values()]
    return dict(zip(keys, torch.stack(values).tolist()))


def with_moe_totals(flat: dict[str, float]) -> dict[str, float]:
    """The layers' rows plus totals over all of them: the largest imbalance and the layer it is in
    (`moe/imbalance`, `moe/imbalance_layer`), the largest coefficient of variation, the dropped assignments
    and, where the rows have them, the dead experts."""
    names = list(dict.fromkeys(key.split("/")[1] for key in flat))
    if not names:
        return {}
    worst = max(names, key=lambda n: flat[f"moe/{n}/imbalance"])
    totals = {
        "moe/imbalance": flat[f"moe/{worst}/imbalance"],
        "moe/imbalance_layer": int(worst),
        "moe/load_cv": max(flat[f"moe/{n}/load_cv"] for n in names),
        "moe/dropped": sum(flat[f"moe/{n}/dropped"] for n in names),
    }
    if all(f"moe/{n}/dead_experts" in flat for n in names):
        totals["moe/dead_experts"] = sum(flat[f"moe/{n}/dead_experts"] for n in names)
    return {**flat, **totals}
