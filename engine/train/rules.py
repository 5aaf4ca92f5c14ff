"""The cross-section rules of training (engine/train/): the optimizer, schedule and loss fields the chosen
components read, combinations of them that work together, the EMA of the weights and the profiling window;
and the warning for a warmup as long as the run.

Torch-free, like every room's rules module (engine/train/optim/ imports torch, so the optimizer's rules live
here): it imports engine.config's sections and helpers only (`JobConfig` for its types alone), and
engine/plan/checks.py runs these functions in the order it lists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config.fields import unread_field_issues
from engine.config.registry import OPTIMIZERS, SCHEDULERS
from engine.errors import ConfigIssue

if TYPE_CHECKING:
    from engine.config.job import JobConfig


def profiling_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """The profiled window starts inside the run."""
    if cfg.profiling.enable and cfg.profiling.start_step > cfg.train.max_steps:
        return [
            ConfigIssue(
                "profiling.start_step",
                f"{cfg.profiling.start_step} is after train.max_steps ({cfg.train.max_steps})",
                "profile a window inside the run",
            )
        ]
    return []


def optimization_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """Optimizer, schedule and loss fields that the chosen components would not read, and combinations
    that do not work together."""
    o, s, t = cfg.optimizer, cfg.scheduler, cfg.train
    issues = OPTIMIZERS.owner_issues("optimizer", o)
    issues += SCHEDULERS.owner_issues("scheduler", s)
    issues += unread_field_issues("train", t, t.loss_fn, {"ce_chunk_size": ("chunked_cross_entropy",)})
    issues += unread_field_issues("train", t, t.mixed_precision, {"fp8_recipe": ("fp8",)})
    if o.name == "schedule_free_adamw" and s.name not in ("constant", "none"):
        issues.append(
            ConfigIssue(
                "scheduler.name",
                f"schedule_free_adamw replaces the LR schedule; {s.name!r} would fight it",
                "set scheduler.name = 'constant' or 'none' (warm up with optimizer.schedule_free_warmup_steps)",
            )
        )
    if o.name == "schedule_free_adamw" and o.betas[0] == 0:
        issues.append(
            ConfigIssue(
                "optimizer.betas",
                "schedule_free_adamw needs betas[0] > 0 (it interpolates between "
                "its averaged and its gradient sequence with it)",
                "use e.g. betas = [0.9, 0.999]",
            )
        )
    if s.cycles is not None and max(s.cycles if isinstance(s.cycles, list) else [s.cycles]) >= t.max_steps:
        issues.append(
            ConfigIssue(
                "scheduler.cycles",
                f"{s.cycles} does not fit in train.max_steps = {t.max_steps}",
                "give fewer cycles, or boundaries below train.max_steps",
            )
        )
    if s.name == "wsd" and s.stable_steps and s.decay_steps is None:
        to_end = t.max_steps - s.warmup_steps - s.stable_steps - 1
        issues.append(
            ConfigIssue(
                "scheduler.decay_steps",
                "wsd with stable_steps needs the length of its decay",
                f"set scheduler.decay_steps (= {to_end} ends the decay on the last step)"
                if to_end > 0
                else "set scheduler.decay_steps, and train longer than warmup + stable steps",
            )
        )
    return issues


def ema_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """The EMA of the weights: its warm-up only with a decay, and not where it is not supported yet."""
    t = cfg.train
    if not t.ema_decay:
        if t.ema_warmup:
            return [ConfigIssue("train.ema_warmup", "is set, but the EMA is off", "set train.ema_decay (e.g. 0.999)")]
        return []
    issues = []
    if cfg.distributed.pp > 1:
        issues.append(
            ConfigIssue(
                "train.ema_decay",
                "an EMA of the weights is not supported with pipeline parallelism (distributed.pp > 1) yet",
                "set train.ema_decay = 0, or train without pipeline parallelism",
            )
        )
    if cfg.optimizer.name == "schedule_free_adamw":
        issues.append(
            ConfigIssue(
                "train.ema_decay",
                "schedule_free_adamw already averages its weights (it evaluates and ships the average)",
                "set train.ema_decay = 0, or use another optimizer",
            )
        )
    return issues


def schedule_warnings(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """Short benchmark presets keep their production warmup (the seed framework runs them), so a warmup as
    long as the run is said out loud, not refused."""
    t, s = cfg.train, cfg.scheduler
    if s.warmup_steps >= t.max_steps and s.name != "none" and s.unit == "steps":
        return [
            ConfigIssue(
                "scheduler.warmup_steps",
                f"{s.warmup_steps} >= train.max_steps ({t.max_steps}): the whole run warms up and the "
                f"learning rate never reaches optimizer.lr (it ends at {t.max_steps / (s.warmup_steps + 1):.3g} × lr)",
                "fine for a short benchmark; shorten the warmup or train longer for a real run",
            )
        ]
    return []


def memory_option_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """The memory options against what they are built and checked for. torchao's AdamW keeps unquantized moments
    in the weights' dtype, so bf16 moments need bf16 weights and bf16 weights fp32-free moments; bf16 weights
    compute in bf16. The torchao states are checked on one process (each rank would quantize or round its own
    shard, which Forge does not test yet), without LoRA and the EMA; they are torchao's optimizers, not
    PyTorch's fused kernel. Activation offload wraps one micro-batch's forward, which a pipeline schedule does
    not expose."""
    o, t, d = cfg.optimizer, cfg.train, cfg.distributed
    torchao = o.state_dtype != "fp32" or o.weight_dtype != "fp32"
    issues = []
    if o.state_dtype == "bf16" and o.weight_dtype != "bf16":
        issues.append(
            ConfigIssue(
                "optimizer.state_dtype",
                '"bf16" moments need optimizer.weight_dtype = "bf16" (torchao keeps them in the weights\' dtype)',
                'set optimizer.weight_dtype = "bf16", or state_dtype = "int8" to shrink the state of fp32 weights',
            )
        )
    if o.weight_dtype == "bf16" and o.state_dtype == "fp32":
        issues.append(
            ConfigIssue(
                "optimizer.weight_dtype",
                '"bf16" weights keep their moments in bf16 or int8, not fp32 (torchao makes them like the weights)',
                'set optimizer.state_dtype = "bf16" or "int8"',
            )
        )
    if o.weight_dtype == "bf16" and t.mixed_precision != "bf16":
        issues.append(
            ConfigIssue(
                "optimizer.weight_dtype",
                f'"bf16" weights compute in bf16, not with train.mixed_precision = {t.mixed_precision!r}',
                'set train.mixed_precision = "bf16"',
            )
        )
    if torchao and o.fused:
        issues.append(
            ConfigIssue(
                "optimizer.fused",
                "optimizer.state_dtype / weight_dtype other than fp32 are torchao's AdamW, which has no fused kernel",
                "leave optimizer.fused unset",
            )
        )
    if torchao and world_size > 1:
        issues.append(
            ConfigIssue(
                "optimizer.state_dtype" if o.state_dtype != "fp32" else "optimizer.weight_dtype",
                f"torchao's {o.state_dtype} state / {o.weight_dtype} weights are supported on one process only so "
                f"far, not on a layout of {world_size} (distributed.*: each rank would quantize or round its own "
                "shard, which is not tested yet)",
                'train on one process, or keep state_dtype and weight_dtype "fp32" on several',
            )
        )
    for field, on in (("lora.enabled", cfg.lora.enabled), ("train.ema_decay", bool(t.ema_decay))):
        if torchao and on:
            issues.append(
                ConfigIssue(
                    field,
                    f"not supported with optimizer.state_dtype = {o.state_dtype!r}, weight_dtype = "
                    f"{o.weight_dtype!r} yet (not tested together)",
                    f"turn {field} off, or keep the optimizer's dtypes fp32",
                )
            )
    if t.activation_offload and d.pp > 1:
        issues.append(
            ConfigIssue(
                "train.activation_offload",
                f"not supported with pipeline parallelism yet (distributed.pp = {d.pp}): the schedule runs "
                "the forwards and backwards of its microbatches itself",
                "set distributed.pp = 1, or leave the activations on the device",
            )
        )
    if t.activation_offload and d.tp > 1:
        issues.append(
            ConfigIssue(
                "train.activation_offload",
                f"not supported with tensor parallelism yet (distributed.tp = {d.tp}): autograd saves DTensors "
                "there, which save_on_cpu's pinned copies (on CUDA) cannot hold",
                "set distributed.tp = 1, or leave the activations on the device",
            )
        )
    return issues


def cpu_offload_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """FSDP2's CPU offload (`distributed.cpu_offload`) is built and checked for data parallelism alone (at world
    size 1 too): the other layouts, LoRA, fp8's float8 all-gather, optimizers other than AdamW, and torchao's optimizers (which
    quantize or round the local tensors FSDP hands them) are not tested with it yet."""
    if not cfg.distributed.cpu_offload:
        return []
    d, o = cfg.distributed, cfg.optimizer
    others = [
        ("distributed.tp", d.tp > 1, f"{d.tp}", "set distributed.tp = 1"),
        ("distributed.pp", d.pp > 1, f"{d.pp}", "set distributed.pp = 1"),
        ("distributed.cp", d.cp > 1, f"{d.cp}", "set distributed.cp = 1"),
        ("distributed.ep", d.ep > 1, f"{d.ep}", "set distributed.ep = 1"),
        ("optimizer.state_dtype", o.state_dtype != "fp32", repr(o.state_dtype), 'keep optimizer.state_dtype = "fp32"'),
        (
            "optimizer.weight_dtype",
            o.weight_dtype != "fp32",
            repr(o.weight_dtype),
            'keep optimizer.weight_dtype = "fp32"',
        ),
        ("train.mixed_precision", cfg.train.mixed_precision == "fp8", '"fp8"', 'use "bf16"'),
        ("lora.enabled", cfg.lora.enabled, "true", "set lora.enabled = false"),
        ("optimizer.name", o.name != "adamw", repr(o.name), 'use optimizer.name = "adamw"'),
    ]
    return [
        ConfigIssue(
            field,
            f"= {value} is not supported with distributed.cpu_offload = true yet (FSDP2's CPU offload is built and "
            "tested for data parallelism with AdamW and fp32 optimizer state only)",
            f"{fix}, or set distributed.cpu_offload = false",
        )
        for field, on, value, fix in others
        if on
    ]
