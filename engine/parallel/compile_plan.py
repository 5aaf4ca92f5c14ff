"""What torch.compile takes as one graph in an MoE block, decided torch-free: engine/parallel/apply.py compiles
by it, and the layout rules (engine/parallel/rules.py) refuse activation checkpointing where it cannot work."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config.job import JobConfig


def moe_compiled_in_regions(cfg: JobConfig, compute_bf16: bool) -> bool:
    """Whether torch.compile takes an MoE block in regions around its routed experts instead of whole
    (engine/parallel/apply.py): whenever the experts' call holds what does not trace into one graph — expert
    parallelism's token exchange, grouped_mm outside bf16."""
    return cfg.distributed.ep > 1 or not compute_bf16
