"""Mixed precision: parameters and optimizer state stay fp32; matmuls run in the compute dtype under autocast.

`fp8` computes in bf16 like `bf16`: the float8 part is the linear layers, which engine.parallel.float8 swaps
for torchao's Float8Linear (their matmuls cast bf16 operands to float8 with dynamic scales); everything else
(attention, norms, the output head, MoE experts) runs in bf16.
"""

from __future__ import annotations

import contextlib

import torch

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.bfloat16}


def compute_dtype(mode: str, device: torch.device) -> torch.dtype:
    """`auto` is bf16 on a GPU that has bf16 hardware, else fp32. On CPU it is fp32 because bf16 speed
    there depends on the chip (emulated, and far slower, without AVX512-BF16/AMX) and CPU runs are where
    exact fp32 results are compared; GPUs before Ampere (V100, T4) only emulate bf16."""
    if mode == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.bfloat16 if bf16 else torch.float32
    return COMPUTE_DTYPES[mode]


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(device: torch.device, dtype: torch.dtype) -> torch.amp.GradScaler:
    """fp16 gradients underflow without loss scaling; for other dtypes the scaler is a pass-through."""
    return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


def cast_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Store the model's trainable parameters in `dtype` (optimizer.weight_dtype), in place of fp32; buffers (RoPE
    tables) keep theirs. A parameter shared by several modules (tied embeddings) stays one parameter."""
    cast: dict[int, torch.nn.Parameter] = {}
    with torch.no_grad():
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if not param.requires_grad or param.dtype == dtype:
                    continue
                if id(param) not in cast:
                    cast[id(param)] = torch.nn.Parameter(param.to(dtype))
                setattr(module, name, cast[id(param)])
