"""Tokens per expert of every MoE layer summed over the training forwards between two logged steps, for the
dead-expert count (`moe/{layer}/dead_experts`: experts that received no token in any micro-batch since the
last logged step).

The last forward's load (what `moe/{layer}/imbalance` reads) cannot say that an expert is dead: one
micro-batch may miss an expert that the next one uses. A forward hook on the model (like the routers'
balancing, engine/train/balancing.py) adds each training forward's load, still on the device, so counting
costs no host synchronisation; the metrics read the sums once per logged step and start new ones. Under
data parallelism the sums are added over the data-parallel group when read (every rank logs at the same
steps), so an expert is dead only if no rank's tokens went to it. The sums are metrics, not training state:
a resumed run starts new ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.train.balancing import training_forward


class ExpertLoadWindow:
    """Layer name → tokens per expert, summed over the training forwards of the models it is attached to
    (a whole model, or each pipeline stage of one: their layer names are distinct)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.sums: dict[str, torch.Tensor] = {}

    def attach(self, model: nn.Module) -> None:
        model.register_forward_hook(self.add)

    def add(self, model: nn.Module, args: tuple, output: torch.Tensor) -> None:
        """Forward hook: add this training forward's load of each layer (evaluation and generation don't count)."""
        if not training_forward(model):
            return
        for name, stats in model.last_moe_stats.items():
            load = stats.load.detach()
            self.sums[name] = self.sums[name] + load if name in self.sums else load.clone()

    def take(self) -> dict[str, torch.Tensor]:
        """The sums since the last call (over the data-parallel group: a collective), and start new ones."""
        sums, self.sums = self.sums, {}
        if self.group is None or not sums:
            return sums
        stacked = torch.stack(list(sums.values()))
        dist.all_reduce(stacked, group=self.group)
        return dict(zip(sums, stacked.unbind()))
