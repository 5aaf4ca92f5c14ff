"""`[lora]`: train low-rank adapters on a frozen (optionally 4-bit) base model instead of the whole model.

Torch-free, like every section: the adapters themselves are engine/model/lora.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from engine.config.base import Section
from engine.errors import ConfigIssue

if TYPE_CHECKING:
    from engine.config.job import JobConfig


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

    readers: ClassVar[dict[str, str]] = {
        "enabled": "model/lora.py, train/job.py, parallel/lora_memory.py, checkpoint/locate.py",
        "rank": "model/lora.py, parallel/lora_memory.py, checkpoint/",
        "alpha": "model/lora.py, checkpoint/",
        "dropout": "model/lora.py, checkpoint/hf_lora.py",
        "target_modules": "model/lora.py, parallel/lora_memory.py",
        "exclude_modules": "model/lora.py, parallel/lora_memory.py",
        "init": "model/lora.py",
        "save_adapters_only": "train/job.py, checkpoint/hf.py",
        "merge_interval": "train/trainer.py",
        "reset_optimizer_on_merge": "train/lora_merge.py",
        "quantize_base": "model/lora.py, parallel/lora_memory.py",
        "group_size": "model/lora.py, parallel/lora_memory.py",
    }
    """The engine modules (under engine/) that read each field: the "read by" column of docs/configuration.md."""


def lora_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """What `[lora]` cannot be combined with yet, each refused with the fix (never silently ignored)."""
    lora = cfg.lora
    if not lora.enabled:
        defaults = LoraConfig()
        return [
            ConfigIssue(f"lora.{name}", "is set, but lora.enabled = false", "set lora.enabled = true, or remove it")
            for name in LoraConfig.model_fields
            if name != "enabled" and getattr(lora, name) != getattr(defaults, name)
        ]
    issues = []

    def refuse(field: str, problem: str, fix: str) -> None:
        issues.append(ConfigIssue(field, problem, fix))

    d = cfg.distributed
    for degree in ("tp", "pp", "cp"):
        if getattr(d, degree) > 1:
            refuse(
                f"distributed.{degree}",
                f"= {getattr(d, degree)}: LoRA adapters are supported under FSDP/HSDP only, not with {degree} > 1 yet",
                f"set distributed.{degree} = 1 (shard with distributed.dp_shard), or lora.enabled = false",
            )
    if cfg.train.ema_decay:
        refuse(
            "train.ema_decay",
            "an EMA of the weights is not supported with LoRA yet (it would average the frozen base too)",
            "set train.ema_decay = 0 with lora.enabled = true",
        )
    if cfg.train.mixed_precision == "fp8":
        refuse(
            "train.mixed_precision",
            '= "fp8": float8 training converts nn.Linear layers, which the adapted ones no longer are',
            'use "bf16" with LoRA',
        )
    if lora.quantize_base is not None:
        if world_size > 1:
            refuse(
                "lora.quantize_base",
                f"a 4-bit base trains in one process only (world size here: {world_size})",
                "train QLoRA in one process, or unset lora.quantize_base and shard the fp32 base with FSDP",
            )
        if not lora.save_adapters_only:
            refuse(
                "lora.quantize_base",
                "the NF4 base cannot go into a checkpoint, so checkpoints must hold the adapters only",
                "set lora.save_adapters_only = true (a resume re-quantizes the base from checkpoint.load_path)",
            )
        if lora.merge_interval is not None:
            refuse(
                "lora.merge_interval",
                "cannot merge into a 4-bit base without re-quantizing it (losing what the adapter learned)",
                "unset lora.merge_interval, or lora.quantize_base",
            )
    if lora.merge_interval is not None:
        if lora.save_adapters_only:
            refuse(
                "lora.merge_interval",
                "merging changes the base weights, which lora.save_adapters_only leaves out of checkpoints",
                "set lora.save_adapters_only = false, or unset lora.merge_interval",
            )
        if cfg.optimizer.name == "schedule_free_adamw":
            refuse(
                "lora.merge_interval",
                "schedule_free_adamw's averaged weights would not follow a merge",
                "use adamw, or unset lora.merge_interval",
            )
    if lora.reset_optimizer_on_merge and lora.merge_interval is None:
        refuse("lora.reset_optimizer_on_merge", "is set, but lora.merge_interval is not", "set lora.merge_interval")
    return issues
