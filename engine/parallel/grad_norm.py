"""Gradient clipping by the global norm, for gradients sharded any way the layouts shard them."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    pipeline_group: dist.ProcessGroup | None = None,
    duplicates: set[torch.Tensor] | frozenset = frozenset(),
) -> torch.Tensor:
    """Clip gradients to a global 2-norm of `max_norm` and return the norm before clipping (`max_norm = inf`
    only measures).

    Gradients may live on different meshes (expert gradients on the ep mesh, the others plain or on the
    dp/tp mesh), which torch's foreach norm and clip cannot mix: one norm per mesh, each reduced over its
    own mesh, then combined, and the clip applied mesh by mesh. Under pipeline parallelism each rank holds
    other layers: the squared norms are summed over `pipeline_group` too, so every rank clips alike.
    `duplicates`: parameters whose gradient another pipeline rank holds as well (a tied embedding's
    second copy), clipped but left out of the norm so that it counts once."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    parameters = list(parameters)
    for param in parameters:
        if param.grad is not None:
            by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    counted = [[p.grad for p in group if p not in duplicates] for group in by_mesh.values()]
    norms = [torch.nn.utils.get_total_norm(grads, foreach=True) for grads in counted if grads]
    plain = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    squares = [n.to(torch.promote_types(n.dtype, torch.float32)).square() for n in plain]  # fp32 at least
    device = parameters[0].device if parameters else None
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if pipeline_group is not None:
        dist.all_reduce(total, group=pipeline_group)
    total = total.sqrt()
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
