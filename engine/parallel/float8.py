"""FP8 training: swap a model's linear layers for torchao's `Float8Linear`.

A converted linear casts its input, weight and output gradient to float8 (e4m3) with dynamic scales
and runs its three matmuls (output, input gradient, weight gradient) through `torch._scaled_mm`; the
parameters, optimizer state and everything outside the converted layers stay as they were (fp32
parameters, bf16 autocast compute; `engine.precision` maps mixed_precision = "fp8" to bf16).
Parameter names and dtypes are unchanged, so checkpoints of a converted model load into a plain one.

Recipes (`train.fp8_recipe`), from torchao's `Float8LinearConfig.from_recipe_name`:
- `tensorwise`: one scale per tensor. Fastest; the only one FSDP2 can all-gather in float8.
- `rowwise`: one scale per row (per token for activations, per output channel for weights), scales
  rounded to powers of two. More accurate with outliers, somewhat slower.
Both run on CPU with torch >= 2.13 (torch._scaled_mm has a CPU kernel), which is what the tests use; on
NVIDIA GPUs, float8 matmuls need compute capability 8.9 or newer (Ada, Hopper, Blackwell).

Not converted: the output head (the family's `ModelParts.head`: the logits' precision matters most for the
loss, and torchao's own guidance keeps it in high precision), the modules the family names in
`ModelParts.high_precision` (the transformer's MoE routers, whose gate runs in fp32 through `F.linear` on the
weight, never through the module), MoE experts (plain parameters driven by grouped_mm, not
`nn.Linear`; torchao's float8 grouped-mm training is a GPU-only prototype), and linears with a dimension
that is not a multiple of 16.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from engine.errors import ConfigIssue, UserError
from engine.model.spec import LanguageModel, ModelParts, spec_for

FP8_RECIPES = ("tensorwise", "rowwise")
MIN_CUDA_CAPABILITY = (8, 9)


def float8_filter(parts: ModelParts) -> Callable[[nn.Module, str], bool]:
    """Which modules `convert_to_float8_training` swaps in a model of `parts` (it passes each module and its
    qualified name)."""
    return functools.partial(converts_to_float8, parts)


def converts_to_float8(parts: ModelParts, module: nn.Module, fqn: str) -> bool:
    """Whether the linear `module` at `fqn` runs in float8: not the head nor what the family keeps in high
    precision, and both of its dimensions multiples of 16."""
    if not isinstance(module, nn.Linear) or fqn == parts.head:
        return False
    if any(fnmatch.fnmatchcase(fqn, pattern) for pattern in parts.high_precision):
        return False
    # torch._scaled_mm on GPUs (cuBLASLt float8) needs both dimensions of the weight to be multiples of 16:
    # in_features is the contracted dimension of the forward and input-gradient matmuls, out_features
    # that of the weight-gradient one. Padding them would copy every activation, so such layers stay bf16.
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def check_float8_device(device: torch.device) -> None:
    """Float8 matmuls exist on CPU and on NVIDIA GPUs of compute capability 8.9+; say so before training."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CUDA_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise UserError(
                f'train.mixed_precision = "fp8" needs float8 matmuls, which NVIDIA GPUs have from '
                f"compute capability 8.9 (Ada, Hopper); {name} has {capability[0]}.{capability[1]}",
                'use train.mixed_precision = "bf16" on this GPU',
            )
    elif device.type != "cpu":
        raise UserError(
            f'train.mixed_precision = "fp8" runs on CPU and NVIDIA GPUs, not on {device.type}',
            'use train.mixed_precision = "bf16"',
        )


CPU_FP8_SLOWDOWN = (
    "how slow depends on the CPU: 3 steps of presets/debug.toml took 741 s against 11 s without fp8 on a 2-core "
    "Intel Xeon (measured 2026-11-26), 1.1 times the fp32 step time on a 2-core AMD EPYC with AVX-512 BF16"
)
"""Measured on 2026-11-26: the Xeon figure by the run reported in issue 28; the EPYC one with `forge train
presets/debug.toml --train.max_steps=2` (610 tokens/s with fp8 at step 2, 684 with the preset's fp32)."""


def float8_device_warnings(mixed_precision: str, device: torch.device) -> list[ConfigIssue]:
    """FP8 on a CPU runs, so that the tests can check it without a GPU, but torch._scaled_mm's CPU kernel is
    an emulation, no fast path: the run goes ahead, and the user learns before waiting how slow it is."""
    if mixed_precision != "fp8" or device.type != "cpu":
        return []
    return [
        ConfigIssue(
            "train.mixed_precision",
            f'"fp8" on a CPU is emulated, for testing only: {CPU_FP8_SLOWDOWN}',
            'train with "bf16" on a CPU; fp8 pays on NVIDIA GPUs of compute capability 8.9 or newer',
        )
    ]


@contextlib.contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """torchao's import logs a warning for each of its optional compiled kernels (MX formats, CUTLASS for
    sm90a) that the installed torch cannot load, e.g. any CPU build, and torch's pytree logs a deprecation
    notice for one of torchao's enums; float8 training uses none of them, so a user should not see them."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def convert_to_float8(
    model: LanguageModel, recipe: str, *, fsdp_float8_all_gather: bool = False, device: torch.device | None = None
) -> list[str]:
    """Swap the eligible linears of `model` (see `float8_filter`) for `Float8Linear`, in place; → their names.

    `fsdp_float8_all_gather`: make the converted weights all-gather in float8 under FSDP2 (half the bytes
    of bf16). Pass it only when the model will be sharded with `fully_shard` on CUDA, and only with the
    tensorwise recipe (torchao supports no other); then call
    `torchao.float8.precompute_float8_dynamic_scale_for_fsdp(model)` after every optimizer step, which
    computes all the weights' scales with one all-reduce instead of one per layer."""
    with quiet_torchao_import():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8 recipe must be one of {', '.join(FP8_RECIPES)}, not {recipe!r}")
    if fsdp_float8_all_gather and recipe != "tensorwise":
        raise ValueError(f"float8 all-gather under FSDP needs the tensorwise recipe, not {recipe!r}")
    check_float8_device(device or next(model.parameters()).device)  # the model may still be on the meta device
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_float8_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=float8_filter(spec_for(model.cfg).parts))
    return [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]
