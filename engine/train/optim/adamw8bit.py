"""torchao's AdamW8bit with 8-bit moments for the hidden matrices only (imported when state_dtype = "int8").

torchao quantizes every tensor of at least 4096 elements. The embedding and the output head are such tensors,
and their rows for rare tokens see gradients orders of magnitude below a block's largest: their second moment
rounds to zero while the first does not, and m / (√v + ε) becomes an update of thousands of learning rates
(measured on the debug model: elements of the head moved by 9 in one step at lr 2e-3, and the loss jumped from
6.3 to 18). As bitsandbytes does for embeddings, they keep fp32 moments here; the 2-D weights inside the blocks
(`hidden_matrices`, engine/parallel/memory.py's "hidden_matrix" kind) are quantized as torchao does.
"""

from __future__ import annotations

import torch
from torchao.optim import AdamW8bit


class HiddenAdamW8bit(AdamW8bit):
    """AdamW8bit whose parameters outside `quantized` (ids) keep unquantized moments, as torchao gives its small
    tensors: the same step function runs on both (torchao's `single_param_adam`)."""

    def __init__(self, params, quantized: frozenset[int], **kwargs) -> None:
        self.quantized = quantized  # before the base class adds the param groups
        super().__init__(params, **kwargs)

    def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        if id(p) not in self.quantized:
            return torch.zeros_like(p)
        return super()._new_buffer(p, signed)
