"""Raw attention weights softmax(QKᵀ/√d) for chosen blocks, heads and query positions.

SDPA never materialises the weights, and the model keeps calling it: a forward hook on the block's attention
core (where the family's `ModelParts.attention` says, the transformer's `attention.core`, whose inputs are the
queries, keys and values after RoPE and QK-norm) recomputes the weights explicitly for only the heads and query positions asked, so a
request costs heads × queries × seq values per window instead of the whole S² for every head.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.config.model import ModelConfig
from engine.errors import UserError
from engine.interp.modules import ModuleOutput, matches
from engine.interp.store import Column


def attention_targets(patterns: Sequence[str], outputs: dict[str, ModuleOutput], core: str | None) -> list[str]:
    """Block names (`layers.N`) the patterns match, in model order: the modules whose attention core (at path
    `core` inside them, the family's `ModelParts.attention`; None: the family has none) ran in the probe; a
    pattern matching no block is a UserError."""
    blocks = [] if core is None else [name.removesuffix(f".{core}") for name in outputs if name.endswith(f".{core}")]
    chosen: set[str] = set()
    for pattern in patterns:
        hit = [block for block in blocks if matches(block, pattern)]
        if not hit:
            raise UserError(
                f"--attention {pattern!r} matches no block of the model",
                f"name blocks, e.g. --attention 'layers.*' or one of: {', '.join(blocks)}",
            )
        chosen.update(hit)
    return [block for block in blocks if block in chosen]


@dataclass(frozen=True)
class AttentionCapture:
    blocks: tuple[str, ...]
    heads: tuple[int, ...]
    query_positions: tuple[int, ...]
    seq_len: int

    @classmethod
    def make(
        cls, blocks: Sequence[str], heads: Sequence[int], positions: Sequence[int], cfg: ModelConfig, seq_len: int
    ) -> AttentionCapture:
        if (heads or positions) and not blocks:
            raise UserError("--heads and --query-positions choose what --attention captures", "add --attention BLOCKS")
        bad = [h for h in heads if not 0 <= h < cfg.n_heads]
        if bad:
            raise UserError(f"--heads {bad[0]} is not a head of the model", f"heads are 0 … {cfg.n_heads - 1}")
        bad = [p for p in positions if not -seq_len <= p < seq_len]
        if bad:
            raise UserError(
                f"--query-positions {bad[0]} is outside a window of {seq_len} tokens",
                f"use 0 … {seq_len - 1}, or negative positions counted from the window's end",
            )
        return cls(tuple(blocks), tuple(heads) or tuple(range(cfg.n_heads)), tuple(positions), seq_len)

    def column_name(self, block: str) -> str:
        return f"{block}.attention.weights"

    def columns(self, dtype: str) -> list[Column]:
        """One row per window: (heads, queries, keys), keys padded to seq_len for a shorter last window."""
        queries = len(self.query_positions) or self.seq_len
        return [Column(self.column_name(b), (len(self.heads), queries, self.seq_len), dtype) for b in self.blocks]

    def describe(self) -> dict:
        return {
            "blocks": list(self.blocks),
            "heads": list(self.heads),
            "query_positions": list(self.query_positions) or "all",
        }

    def catch(self, block: str, args: tuple, kwargs: dict, caught: dict[str, torch.Tensor]) -> None:
        """From the core's inputs (q, k, v, mask, causal, sinks), the weights of the chosen heads and queries."""
        inputs = dict(zip(("q", "k", "v", "mask", "causal", "sinks"), args)) | kwargs
        caught[self.column_name(block)] = self.weights(
            inputs["q"], inputs["k"], inputs.get("mask"), inputs.get("causal", True), inputs.get("sinks")
        )

    def weights(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        mask: torch.Tensor | None = None,
        causal: bool = True,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q (batch, heads, L, d), k (batch, kv_heads, L, d) → (batch, chosen heads, queries, seq_len) fp32, with
        the masks SDPA applies (causal, and an explicit boolean or additive mask when the caller passes one);
        queries past a short window's end are rows of zeros. With sink logits [heads] (model.attention_sinks)
        each row's softmax has the sink's column too, left out: the row sums to what the keys received, < 1."""
        batch, n_heads, length, dim = q.shape
        heads = torch.tensor(self.heads, device=q.device)
        k = k[:, heads // (n_heads // k.shape[1])]  # the kv head each query head reads (grouped-query)
        wanted = self.query_positions or tuple(range(self.seq_len))
        resolved = [p + length if p < 0 else p for p in wanted]
        inside = [i for i, p in enumerate(resolved) if 0 <= p < length]
        rows = torch.tensor([resolved[i] for i in inside], device=q.device, dtype=torch.long)
        out = torch.zeros(batch, len(self.heads), len(wanted), self.seq_len, dtype=torch.float32, device=q.device)
        if not inside:
            return out
        scores = (q[:, heads][:, :, rows].float() @ k.float().transpose(-1, -2)) / math.sqrt(dim)
        if causal:
            scores = scores.masked_fill(
                torch.arange(k.shape[2], device=q.device)[None, :] > rows[:, None], float("-inf")
            )
        if mask is not None:
            mask = mask.expand(batch, n_heads, length, k.shape[2])[:, heads][:, :, rows]
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
        if sinks is None:
            out[:, :, inside, : k.shape[2]] = torch.softmax(scores, dim=-1)
            return out
        sink = sinks.float()[heads][None, :, None, None].expand(*scores.shape[:-1], 1)
        out[:, :, inside, : k.shape[2]] = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return out
