"""Gradient clipping by the global norm, for gradients sharded any way the layouts shard them."""

from __future__ import annotations

from typing import Iterable

import torch
from torch.distributed.tensor import DTensor


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip gradients to a global 2-norm of `max_norm` and return the norm before clipping, for gradients
    that live on different meshes (expert gradients on the ep mesh, the others plain or on the dp mesh),
    which torch's foreach norm and clip cannot mix: one norm per mesh, each reduced over its own mesh, then
    combined; and the clip applied mesh by mesh. Works as well without expert parallelism."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True) for group in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack([(n.full_tensor() if isinstance(n, DTensor) else n).float()
                                                  for n in norms]))
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
