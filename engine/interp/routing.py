"""MoE routing per token: which experts each token was sent to, and with what weight.

The router of a MoE block (where the family's `ModelParts.router` says, the transformer's
`layers.N.feed_forward.router`) returns a `Routing` whose experts and weights are
(tokens, k) over the batch's flattened positions; a forward hook on it reshapes them to (batch, seq, k), so
they are stored as rows like any layer: `layers.N.routing.experts` (int32) and `layers.N.routing.weights`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import UserError
from engine.interp.modules import matches
from engine.interp.store import Column
from engine.model.spec import spec_for


def routing_targets(patterns: Sequence[str], model: nn.Module) -> list[str]:
    """Block names (`layers.N`) of the blocks with a router (`ModelParts.router`) the patterns match, in model order."""
    parts = spec_for(model.cfg).parts
    blocks = [f"{parts.blocks}.{name}" for name in parts.in_blocks(model, parts.router)]
    chosen: set[str] = set()
    for pattern in patterns:
        hit = [block for block in blocks if matches(block, pattern)]
        if not hit:
            have = ", ".join(blocks) if blocks else "none: the model is dense (model.num_experts = 0)"
            raise UserError(f"--routing {pattern!r} matches no MoE block", f"its MoE blocks: {have}")
        chosen.update(hit)
    return [block for block in blocks if block in chosen]


@dataclass(frozen=True)
class RoutingCapture:
    blocks: tuple[str, ...]
    top_k: int
    router: str | None  # the router's path inside a block (ModelParts.router)

    def columns(self, dtype: str) -> list[Column]:
        return [
            column
            for block in self.blocks
            for column in (
                Column(f"{block}.routing.experts", (self.top_k,), "I32"),
                Column(f"{block}.routing.weights", (self.top_k,), dtype),
            )
        ]

    def modules(self) -> dict[str, str]:
        """Module name → block, for the hooks."""
        return {f"{block}.{self.router}": block for block in self.blocks}

    def catch(self, block: str, output: object, batch: int, caught: dict[str, torch.Tensor]) -> None:
        caught[f"{block}.routing.experts"] = output.experts.reshape(batch, -1, self.top_k)
        caught[f"{block}.routing.weights"] = output.weights.reshape(batch, -1, self.top_k)
