"""Packed windows: which document each token belongs to, where it sits in it, and who it may attend to.

With `data.pack_sequences`, a training window holds several documents back to back (each ends with the
tokenizer's end-of-document token; `forge tokenize` never lets that token occur inside a document, so it
marks the boundaries exactly). Each document must be trained on as if it were alone: its RoPE positions
restart at 0 and its tokens attend only to earlier tokens of the same document. These helpers turn a
window's tokens into document ids, then into per-token positions and a block-diagonal causal mask; the
transformer takes the ids (`Transformer.forward(..., doc_ids=)`) and builds the rest itself.
"""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """tokens [batch, seq] → int64 [batch, seq], the index of each token's document within its window. The
    end-of-document token belongs to the document it ends; the token after it starts the next one. A
    document cut by the window's start or end counts as a document of its own (its positions restart)."""
    ends = (tokens == eos_id).long()
    return torch.cumsum(ends, dim=1) - ends


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids [batch, seq] (non-decreasing along seq) → int64 [batch, seq]: each token's position inside its
    document, 0 at the document's first token."""
    seq = doc_ids.shape[1]
    index = torch.arange(seq, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    return index - first


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids [batch, seq] → bool [batch, 1, seq, seq], True where query i may attend to key j: j ≤ i and both
    in the same document (block-diagonal causal). The head dimension of 1 broadcasts over every head."""
    seq = doc_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same & causal)[:, None]
