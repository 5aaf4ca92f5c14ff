"""Packed windows: which document each token belongs to, where it sits in it, and who it may attend to.

With `data.pack_sequences`, a training window holds several documents back to back (each ends with the
tokenizer's end-of-document token; `forge tokenize` never lets that token occur inside a document, so it
marks the boundaries exactly). Each document must be trained on as if it were alone: its RoPE positions
restart at 0 and its tokens attend only to earlier tokens of the same document. These helpers turn a
window's tokens into document ids, then into per-token positions and a block-diagonal causal mask; the
transformer takes the ids (`Transformer.forward(..., doc_ids=)`) and builds the rest itself.

The mask takes one of two forms, chosen by the device (engine/model/packed_kernel.py): on CUDA a
FlexAttention `BlockMask` (`document_block_mask`), elsewhere a dense boolean mask for SDPA
(`document_mask`; PyTorch's FlexAttention has no backward on CPU). Both allow exactly the same pairs
(tests/data/test_packing.py compares the two paths' logits).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

from engine.model.packed_kernel import FLEX_BLOCK, packed_attention_backend


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


def packed_attention_mask(
    doc_ids: torch.Tensor, head_dim: int, sliding_window: int | None = None
) -> torch.Tensor | BlockMask:
    """The mask of packed windows for the attention kernel chosen for `doc_ids`' device and this head size.
    With a sliding window (model.sliding_window) the BlockMask holds it too; attention adds it to the
    dense mask (engine.model.attention.Attention)."""
    if packed_attention_backend(doc_ids.device.type, head_dim, doc_ids.shape[1]) == "flex":
        return document_block_mask(doc_ids, sliding_window)
    return document_mask(doc_ids)


def document_block_mask(doc_ids: torch.Tensor, sliding_window: int | None = None) -> BlockMask:
    """doc_ids [batch, seq] → FlexAttention's BlockMask of `document_mask`'s pairs (query i sees key j when
    j ≤ i and both are in the same document), one for every head. On CUDA the builder runs compiled
    (`torch.compile(create_block_mask)`, as FlexAttention's documentation recommends: eager it evaluates the
    mask at every one of the seq × seq pairs at once); its [batch, 1, seq/128, seq/128] block indices are all
    it keeps (FLEX_BLOCK = 128). With a sliding window, j must also be fewer than `sliding_window` before i."""
    batch, seq = doc_ids.shape
    build = compiled_create_block_mask() if doc_ids.is_cuda else create_block_mask
    mask_mod = document_mask_mod(doc_ids, sliding_window)
    return build(mask_mod, batch, None, seq, seq, device=doc_ids.device, BLOCK_SIZE=FLEX_BLOCK)


def document_mask_mod(doc_ids: torch.Tensor, sliding_window: int | None = None) -> Callable:
    """FlexAttention's mask function (batch, head, query, key index tensors → bool) of `document_mask`'s pairs,
    and with a sliding window only keys fewer than `sliding_window` before the query."""

    def same_document_causal(b, h, q, kv):
        return (q >= kv) & (doc_ids[b, q] == doc_ids[b, kv])

    def same_document_in_window(b, h, q, kv):
        return same_document_causal(b, h, q, kv) & (q - kv < sliding_window)

    return same_document_causal if sliding_window is None else same_document_in_window


@functools.cache
def compiled_create_block_mask():
    """Compiled once per process; each call's mask function, a new closure over its doc_ids, is traced as
    the same code with a new tensor input, so the compiled builder is reused while the shapes stay."""
    return torch.compile(create_block_mask, dynamic=False)


def flex_document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of q [batch, heads, seq, head_dim] over k, v (fewer heads: grouped-query) under a document
    block mask. Compiled on CUDA, where eager FlexAttention would materialise the whole score matrix.
    With sink logits [heads] (model.attention_sinks), each query's softmax denominator Z = exp(lse) gains
    exp(sink): the output is FlexAttention's times Z / (Z + exp(sink)) = sigmoid(lse − sink)."""
    kernel = compiled_flex_attention() if q.is_cuda else flex_attention
    gqa = k.shape[1] != q.shape[1]
    if sinks is None:
        return kernel(q, k, v, block_mask=mask, enable_gqa=gqa)
    out, aux = kernel(q, k, v, block_mask=mask, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    return out * torch.sigmoid(aux.lse - sinks.to(aux.lse.dtype)[None, :, None]).unsqueeze(-1).to(out.dtype)


@functools.cache
def compiled_flex_attention():
    return torch.compile(flex_attention, dynamic=False)
