"""Which attention kernel packed windows (data.pack_sequences) use on a device, and which SDPA kernels a CPU
has (`CPU_SDPA_BACKENDS`, what training checks `model.sdpa_backend` against), without torch: the model
(engine/model/documents.py) builds its mask by this choice, and the memory estimate (engine/parallel/memory.py,
read by validate-config without torch) counts that mask.

On CUDA, FlexAttention with a document block mask: its fused kernel skips every FLEX_BLOCK × FLEX_BLOCK block
of the score matrix that lies wholly outside a document or above the diagonal, and no [seq, seq] mask is kept.
Everywhere else, and on CUDA where FlexAttention cannot run or has nothing to skip, SDPA with a dense boolean
mask. PyTorch's fused FlexAttention needs a head dimension of at least 16 (an NYI error below), and a window
shorter than one block has no block to skip (and would take FlexAttention's decoding kernel, which needs a
power-of-2 grouped-query ratio). Which of the two is faster on a GPU is not measured yet: no GPU was
available when this was written (docs/data.md).
"""

from __future__ import annotations

CPU_SDPA_BACKENDS = ("auto", "math", "flash")  # the kernels PyTorch has for CPU tensors
FLEX_BLOCK = 128  # FlexAttention's default block size, which engine.model.documents uses
FLEX_MIN_HEAD_DIM = 16
PACKED_ATTENTION = {"cuda": "flex"}  # device type → kernel for packed windows; any other device: "sdpa"


def packed_attention_backend(device_type: str, head_dim: int, seq_len: int) -> str:
    """ "flex" (a FlexAttention block mask) or "sdpa" (a dense boolean mask) for packed windows of `seq_len`
    tokens and heads of `head_dim` on a device type."""
    if PACKED_ATTENTION.get(device_type) != "flex" or head_dim < FLEX_MIN_HEAD_DIM or seq_len < FLEX_BLOCK:
        return "sdpa"
    return "flex"
