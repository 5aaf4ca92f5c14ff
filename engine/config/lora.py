"""`[lora]`: train low-rank adapters on a frozen (optionally 4-bit) base model instead of the whole model.

Torch-free, like every section: the adapters themselves are engine/model/lora.py, and what they cannot be
combined with yet is refused by engine/model/rules.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.config.base import Section


class LoraConfig(Section):
    enabled: bool = Field(
        False, description="replace the target linears by base + (alpha / rank) · B·A; only A and B train"
    )
    rank: int = Field(8, ge=1, description="the adapters' rank r: A is [r, in], B is [out, r]")
    alpha: float = Field(16.0, gt=0, description="the adapter output is scaled by alpha / rank (peft's lora_alpha)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input (training only)")
    target_modules: list[str] = Field(
        default_factory=lambda: ["layers.*.attention.w[qkvo]"],
        min_length=1,
        description="fnmatch globs over the model's linear module names, e.g. 'layers.*.attention.w[qkvo]', "
        "'layers.*.feed_forward.*', 'output'; each must match at least one linear",
    )
    exclude_modules: list[str] = Field(
        default_factory=list, description="globs of module names left without an adapter, e.g. 'layers.0.*'"
    )
    init: Literal["kaiming", "gaussian"] = Field(
        "kaiming",
        description="A's initialisation: kaiming-uniform (a = √5, nn.Linear's and peft's default) or "
        "normal(0, 1/rank) (peft's 'gaussian'); B is always zero, so step 0 computes the base model exactly",
    )
    save_adapters_only: bool = Field(
        False,
        description="checkpoints hold the trainable weights only, not the frozen base; a resumed run "
        "rebuilds the base from checkpoint.load_path (or the seed)",
    )
    merge_interval: int | None = Field(
        None,
        gt=0,
        description="every N steps add (alpha / rank) · B·A into the base weight and restart the adapters "
        "(A re-initialised, B = 0); unset = never",
    )
    reset_optimizer_on_merge: bool = Field(
        False, description="zero the adapters' optimizer state (moments, step) at each merge"
    )
    quantize_base: Literal["nf4"] | None = Field(
        None,
        description="QLoRA: store the frozen base of the target linears as torchao NF4 (4-bit) and dequantize "
        "it on the fly in forward; unset = keep the base in fp32",
    )
    group_size: int = Field(64, ge=2, description="quantize_base: weights per NF4 scale block (torchao's block_size)")
