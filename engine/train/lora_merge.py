"""The periodic merge of LoRA adapters into their base weights (`lora.merge_interval`), a step of training.

It lives here, not with the adapters (engine/model/lora.py), because it works on the parameters as training
holds them: plain, or FSDP-sharded DTensors whose full value is gathered, updated and re-sharded, and
the optimizer's state of the adapters. The model package stays free of sharding code.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config.lora import LoraConfig
from engine.model.lora import adapters, init_adapter_a


@torch.no_grad()
def merge_adapters(
    model: nn.Module,
    cfg: LoraConfig,
    seed: int,
    optimizer: torch.optim.Optimizer | None = None,
) -> int:
    """Add every adapter's (alpha / r)·B·A into its base weight and restart it (A re-drawn from a generator
    seeded with `seed`, B = 0), so the model computes the same function before and after; with
    `reset_optimizer_on_merge`, zero the adapters' optimizer state (moments and step count: a fresh start).
    Works on plain and FSDP-sharded (DTensor) parameters: the update is formed whole and re-sharded like
    the weight. → the number of adapters merged."""
    generator = torch.Generator().manual_seed(seed)
    modules = adapters(model)
    for module in modules.values():
        delta = whole(module.lora_B) @ whole(module.lora_A) * module.scaling
        assign(module.weight, whole(module.weight) + delta.to(module.weight.dtype))
        fresh_a = torch.empty(module.lora_A.shape, dtype=module.lora_A.dtype)
        init_adapter_a(fresh_a, cfg.init, module.rank, generator)
        assign(module.lora_A, fresh_a)
        module.lora_B.zero_()
        if optimizer is not None and cfg.reset_optimizer_on_merge:
            for param in (module.lora_A, module.lora_B):
                for value in optimizer.state.get(param, {}).values():
                    if torch.is_tensor(value):
                        value.zero_()
    return len(modules)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of a parameter, sharded (DTensor) or not, on its device."""
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach()


def assign(param: torch.Tensor, value: torch.Tensor) -> None:
    """param ← value (a full tensor), keeping param's sharding when it is a DTensor."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
    param.copy_(value.to(param.device))
