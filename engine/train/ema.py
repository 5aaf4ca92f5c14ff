"""An exponential moving average (EMA) of the weights, `train.ema_decay`.

After every applied optimizer step s (1, 2, …; a skipped step changes neither the weights nor the EMA):

    ema ← decay_s · ema + (1 − decay_s) · weights
    decay_s = min(train.ema_decay, (1 + s) / (10 + s))   with train.ema_warmup
    decay_s = train.ema_decay                            without

The warm-up keeps the first weights (often just the initialisation) from dominating the average for the
first ~1/(1 − ema_decay) steps. The EMA starts equal to the weights the run starts from.

The average is kept in fp32, one tensor per parameter with that parameter's layout: under FSDP (or tensor
parallelism) each rank averages its own shards, nothing is gathered, and the checkpoint holds it as DTensors
(entry "ema", under the parameters' names), so it resumes exactly and reshards like the weights. Evaluation
swaps it into the parameters and back bit for bit (`swapped_in`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from engine.checkpoint.locate import EMA_KEY as STATE_KEY  # its checkpoint entry and train-state flag
from engine.config.train import TrainConfig

log = logging.getLogger("forge.train")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor, sharing its memory."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class WeightAverage:
    """The EMA of one model's parameters (this rank's shards of them)."""

    def __init__(self, model: nn.Module, decay: float, warmup: bool) -> None:
        self.decay, self.warmup = decay, warmup
        self.model = model
        named = [(name, p) for name, p in model.named_parameters()]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.averages = [torch.empty_like(p, dtype=torch.float32).copy_(p) for p in self.params]

    @classmethod
    def for_training(cls, model: nn.Module, t: TrainConfig) -> WeightAverage | None:
        """The run's EMA, or None when `train.ema_decay` is 0 (off)."""
        return cls(model, t.ema_decay, t.ema_warmup) if t.ema_decay > 0 else None

    def decay_at(self, step: int) -> float:
        return min(self.decay, (1 + step) / (10 + step)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold in the weights of applied step `step`: one fused lerp over this rank's shards."""
        weights = [local(p).detach().float() for p in self.params]
        torch._foreach_lerp_([local(a) for a in self.averages], weights, 1.0 - self.decay_at(step))

    @torch.no_grad()
    def reset(self) -> None:
        """Start the average again from the current weights."""
        for average, p in zip(self.averages, self.params):
            local(average).copy_(local(p))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averages themselves (not copies), by parameter name: a checkpoint load fills them in place."""
        return dict(zip(self.names, self.averages))

    def after_load(self, train_state: dict[str, Any]) -> None:
        """After a checkpoint was loaded: one saved without an EMA (EMA turned on for a resumed run) leaves
        the average to start from the restored weights."""
        if not train_state.get(STATE_KEY):
            log.warning("the checkpoint holds no EMA of the weights; the EMA starts from its weights")
            self.reset()

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Inside: the parameters hold the EMA (cast to their dtype); after: exactly the weights they held."""
        with torch.no_grad():
            weights = [p.detach().clone() for p in self.params]
            drop_gathered_weights(self.model)
            for p, average in zip(self.params, self.averages):
                local(p).copy_(local(average))
        try:
            yield
        finally:
            with torch.no_grad():
                drop_gathered_weights(self.model)
                for p, w in zip(self.params, weights):
                    p.copy_(w)


def drop_gathered_weights(model: nn.Module) -> None:
    """FSDP keeps a unit's gathered weights after a forward without backward where it does not reshard after
    forward (the last block), and its next forward uses them again: before the shards change in place, those
    copies go, so the next forward gathers the new values."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
