"""A tiny MoE model and the counter of host synchronisations (the ops that make the host wait for the device)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.config.model import ModelConfig
from engine.model.transformer import Transformer


def tiny_moe(router: str, **fields) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        dim=32,
        n_layers=3,
        n_heads=4,
        vocab_size=97,
        max_seq_len=32,
        num_experts=16,
        moe_top_k=2,
        moe_router=router,
        moe_shared_experts=1,
        **fields,
    )
    model = Transformer(cfg)
    model.init_weights()
    return model


SYNC_OPS = {
    torch.ops.aten._local_scalar_dense.default,  # .item(), .tolist(), bool(tensor), int(tensor)
    torch.ops.aten.nonzero.default,  # an output shape that depends on the data
    torch.ops.aten.masked_select.default,
    torch.ops.aten.unique_consecutive.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.repeat_interleave.Tensor,  # without output_size
    torch.ops.aten.bincount.default,  # its output size is the largest index: a sync on a GPU
}


class CountSyncs(TorchDispatchMode):
    """Counts the ops reaching dispatch that make the host wait for the device's data."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNC_OPS:
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


HOST_READS = {
    torch.Tensor.tolist: "tolist",  # on a CPU tensor these read memory directly, below dispatch
    torch.Tensor.item: "item",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
    torch.Tensor.numpy: "numpy",
}
