"""Keys and values of the positions a model has already processed, so that sampling one more token costs
one position of compute instead of re-running the whole sequence.

Only inference uses it: training calls the model without a cache and never meets this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config.model import ModelConfig


@dataclass
class LayerKV:
    """One layer's slice of the cache, as attention sees it during one forward call."""

    keys: torch.Tensor  # [batch, kv_heads, capacity, head_dim]
    values: torch.Tensor  # [batch, kv_heads, capacity, head_dim]
    start: int  # positions cached before this call; the new ones go right after

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' keys and values; return those of every position so far."""
        end = self.start + k.shape[2]
        self.keys[:, :, self.start : end] = k
        self.values[:, :, self.start : end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]

    def mask(self, seq: int) -> torch.Tensor | None:
        """Which cached keys each of the `seq` new queries may see. None where SDPA needs no mask: a call
        that starts at position 0 is plain causal attention, and a single new query sees every key."""
        if self.start == 0 or seq == 1:
            return None
        end = self.start + seq
        keys = torch.arange(end, device=self.keys.device)
        queries = torch.arange(self.start, end, device=self.keys.device)
        return keys[None, :] <= queries[:, None]


class KVCache:
    """Preallocated keys and values for `capacity` positions of every layer.

    `Transformer.forward(tokens, cache)` processes positions `cache.length … cache.length + seq - 1`
    (RoPE is applied at those positions) and then advances `cache.length` by `seq`.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer_names: list[str],
        batch: int,
        capacity: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if capacity > cfg.max_seq_len:
            raise ValueError(f"a cache of {capacity} positions exceeds model.max_seq_len = {cfg.max_seq_len}")
        shape = (batch, cfg.kv_heads, capacity, cfg.head_dim)
        self.keys = {name: torch.zeros(shape, device=device, dtype=dtype) for name in layer_names}
        self.values = {name: torch.zeros(shape, device=device, dtype=dtype) for name in layer_names}
        self.capacity = capacity
        self.length = 0

    def layer(self, name: str, seq: int) -> LayerKV:
        """Layer `name`'s view for a call that adds `seq` positions."""
        if self.length + seq > self.capacity:
            raise ValueError(f"{self.length} cached + {seq} new positions exceed the cache's {self.capacity}")
        return LayerKV(self.keys[name], self.values[name], self.length)
