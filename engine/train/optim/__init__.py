"""Optimizers, chosen by `optimizer.name`; one module each, and beside it its torch-free config
(`NAME_config.py`: its own fields, its state size and its registration in `OPTIMIZERS`).

Importing this package imports no torch: it registers the configs (the `[optimizer]` section is composed of them),
and `build_optimizer` and the other torch helpers of `build.py` load when first used.
"""

from __future__ import annotations

from typing import Any

# One line per optimizer: its config module registers it (and names the builder it imports when built).
from engine.train.optim import adamw_config, lion_config, muon_config, schedule_free_config  # noqa: F401

__all__ = ["build_optimizer", "current_lr", "eval_mode", "hidden_matrices", "param_groups"]
TORCH_HELPERS = {
    "build_optimizer": "build",
    "apply_lr_multipliers": "build",
    "current_lr": "build",
    "eval_mode": "build",
    "hidden_matrices": "groups",
    "param_groups": "groups",
}


def __getattr__(name: str) -> Any:
    if name in TORCH_HELPERS:
        import importlib

        return getattr(importlib.import_module(f"engine.train.optim.{TORCH_HELPERS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
