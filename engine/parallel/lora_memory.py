"""What `[lora]` changes in the per-rank memory estimate (engine/parallel/memory.py), torch-free like it.

With LoRA the base weights are frozen: they are held (fp32, or NF4 under `lora.quantize_base`), but have no
gradients and no optimizer state. Each adapted linear adds A [r, in] and B [out, r] (fp32), which train: they
have gradients and optimizer state like any parameter. An NF4 weight takes 4 bits per element, plus one 8-bit
scale per `group_size` elements and one fp32 factor per (up to) 256 scales (torchao's NF4Tensor), i.e.
0.5 + 1/group_size + 4/(256·group_size) bytes per element (0.516 at the default group size 64).
What the estimate leaves out: the adapters' own activations (dropout(x) and A·x, [tokens, r] per adapted
linear: small next to the block's), and FSDP's unsharded-gradient buffer is still sized for a whole block.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import replace

from engine.config.lora import LoraConfig
from engine.model.spec import ParamSpec

FP32 = 4
NF4_SCALER_BLOCK = 256  # torchao's default scaler_block_size: blocks per fp32 factor


def is_target(spec: ParamSpec, lora: LoraConfig) -> bool:
    """Whether `spec` is the weight of a linear that `lora` adapts (the globs of engine.model.lora.target_names)."""
    if not lora.enabled or not spec.name.endswith(".weight") or len(spec.shape) != 2 or ".experts." in spec.name:
        return False
    module = spec.name.removesuffix(".weight")
    chosen = any(fnmatch.fnmatchcase(module, p) for p in lora.target_modules)
    return chosen and not any(fnmatch.fnmatchcase(module, p) for p in lora.exclude_modules)


def with_adapters(specs: list[ParamSpec], lora: LoraConfig) -> list[ParamSpec]:
    """`specs` plus each target's lora_A [r, in] and lora_B [out, r], owned like their weight; FSDP shards
    them on dim 0 like every parameter, tensor parallelism never (it is refused with LoRA)."""
    out = list(specs)
    for spec in specs:
        if is_target(spec, lora):
            module = spec.name.removesuffix(".weight")
            rows, cols = spec.shape
            out.append(replace(spec, name=f"{module}.lora_A", shape=(lora.rank, cols), tp_dim=None))
            out.append(replace(spec, name=f"{module}.lora_B", shape=(rows, lora.rank), tp_dim=None))
    return out


def trains(spec: ParamSpec, lora: LoraConfig) -> bool:
    """Whether the parameter gets gradients and optimizer state: all of them without LoRA, the adapters with it."""
    return not lora.enabled or spec.name.endswith((".lora_A", ".lora_B"))


def weight_bytes(spec: ParamSpec, local: int, lora: LoraConfig) -> int:
    """Bytes of the parameter's `local` elements: fp32, or NF4 for a quantized base weight."""
    if lora.quantize_base == "nf4" and is_target(spec, lora):
        group = lora.group_size
        return math.ceil(local / 2 + local / group + FP32 * local / (group * NF4_SCALER_BLOCK))
    return FP32 * local
