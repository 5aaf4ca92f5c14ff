"""Training losses, chosen by `train.loss_fn`. Computed in fp32 whatever the compute dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config.registry import LOSSES


@LOSSES.register("cross_entropy")
def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; logits [batch, seq, vocab], labels [batch, seq]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build_loss(name: str):
    return LOSSES.get(name)
