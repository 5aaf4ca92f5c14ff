"""LoRA and QLoRA: low-rank adapters on a frozen base, applied to a built `Transformer` from outside.

`apply_lora` replaces each target `nn.Linear` (chosen by glob over module names) by a `LoRALinear` that keeps
the base weight as its own parameter `weight`, under the name the linear had, and adds `lora_A` [r, in] and
`lora_B` [out, r]:

    y = x Wᵀ + (alpha / r) · B A dropout(x)ᵀ        (peft's LoRA, term for term in the same order)

Why module replacement and not parametrizations or hooks: the state-dict names of the base weights do not
change (`layers.0.attention.wq.weight`), so `checkpoint.load_path`, the Hugging Face mapping, weight init and
FSDP's per-block sharding keep working untouched, and the adapters get names of their own (`….wq.lora_A`)
that map one-to-one onto peft's (`….q_proj.lora_A.weight`). A parametrization would rename the base to
`….parametrizations.weight.original` and recompute the full W + BA on every access (a full-size temporary
per linear); a forward hook would be a patched instance method in all but name.

Every other parameter of the model is frozen (requires_grad = False), so the optimizer, which only takes
parameters that require grad (engine/train/optim/groups.py), keeps no state for them.

With `quantize_base = "nf4"` (QLoRA) the frozen base is a torchao `NF4Tensor` (4-bit NormalFloat codes, one
scale per `group_size` weights, scales themselves quantized to 8 bits per 256 blocks) and `NF4LoRALinear`
dequantizes it on the fly in forward and backward (torchao's `linear_nf4`, which keeps only the 4-bit weight
for backward). The order of the build is fixed (engine/train/job.py): build → load `checkpoint.load_path` →
`apply_lora` → parallelize (activation checkpointing, compile, FSDP2).
"""

from __future__ import annotations

import fnmatch
import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.config.lora import LoraConfig
from engine.errors import UserError

ADAPTER_NAMES = ("lora_A", "lora_B")
NF4_SCALER_BLOCK = 256  # torchao's default: group scales per fp32 factor


class LoRALinear(nn.Module):
    """A linear layer without bias whose `weight` is frozen and whose low-rank update B·A trains."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the same Parameter: a tied weight stays tied
        self.weight.requires_grad_(False)
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **factory))
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_forward(x) + F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scaling

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def delta(self) -> torch.Tensor:
        """(alpha / r) · B·A, the adapter's change of `weight` ([out, in])."""
        return (self.lora_B @ self.lora_A) * self.scaling

    @torch.no_grad()
    def reset_adapter(self, init: str, generator: torch.Generator | None = None) -> None:
        """A as `init` says, B = 0: the adapter then adds exactly nothing."""
        init_adapter_a(self.lora_A, init, self.rank, generator)
        self.lora_B.zero_()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, alpha={self.alpha}"


class NF4LoRALinear(LoRALinear):
    """QLoRA: the frozen base weight is a torchao NF4Tensor, dequantized to the input's dtype on the fly."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, group_size: int) -> None:
        super().__init__(base, rank, alpha, dropout)
        from torchao.quantization import to_nf4

        weight = base.weight.detach()
        if weight.numel() % group_size:
            raise UserError(
                f"lora.group_size = {group_size} does not divide a {list(weight.shape)} weight into whole groups",
                "choose a power of two that divides the model's dimensions (e.g. 64)",
            )
        # The 8-bit group scales are themselves scaled per block of up to 256 of them (torchao needs a divisor).
        scaler_block = math.gcd(weight.numel() // group_size, NF4_SCALER_BLOCK)
        nf4 = to_nf4(weight, block_size=group_size, scaler_block_size=scaler_block)
        self.weight = nn.Parameter(nf4, requires_grad=False)

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight)


def init_adapter_a(a: torch.Tensor, init: str, rank: int, generator: torch.Generator | None = None) -> None:
    """peft's initialisations of A: kaiming-uniform with a = √5 (nn.Linear's), or normal(0, 1/r)."""
    if init == "kaiming":
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    else:
        nn.init.normal_(a, std=1 / rank, generator=generator)


def linear_names(model: nn.Module) -> list[str]:
    """The names of the model's plain linear layers, the modules an adapter can go on."""
    return [name for name, module in model.named_modules() if type(module) is nn.Linear]


def target_names(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """The linears `cfg.target_modules` matches and `cfg.exclude_modules` does not; a glob that matches no
    linear is a UserError (a typo would otherwise train nothing, or less than asked)."""
    linears = linear_names(model)
    for pattern in cfg.target_modules:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in linears):
            raise UserError(
                f"lora.target_modules: {pattern!r} matches none of the model's linear layers",
                f"use globs over names like {', '.join(linears[:4])}, … (e.g. 'layers.*.attention.w[qkvo]')",
            )
    chosen = [n for n in linears if any(fnmatch.fnmatchcase(n, p) for p in cfg.target_modules)]
    chosen = [n for n in chosen if not any(fnmatch.fnmatchcase(n, p) for p in cfg.exclude_modules)]
    if not chosen:
        raise UserError(
            "lora.exclude_modules excludes every linear that lora.target_modules selects", "narrow exclude_modules"
        )
    return chosen


def apply_lora(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Freeze the model and put an adapter on each target linear (in place); → the adapted module names.
    A is initialised from the global RNG, so a seeded run gets the same adapters on every attempt."""
    names = target_names(model, cfg)
    for param in model.parameters():
        param.requires_grad_(False)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, child)
        if cfg.quantize_base == "nf4":
            adapted = NF4LoRALinear(base, cfg.rank, cfg.alpha, cfg.dropout, cfg.group_size)
        else:
            adapted = LoRALinear(base, cfg.rank, cfg.alpha, cfg.dropout)
        adapted.reset_adapter(cfg.init)
        setattr(parent, child, adapted)
    return names


def adapters(model: nn.Module) -> dict[str, LoRALinear]:
    """Module name → LoRALinear of every adapted linear (names as in the model, wrappers' prefixes removed)."""
    return {clean_name(name): m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def clean_name(name: str) -> str:
    """A module name without the prefixes activation checkpointing and compile insert."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name


def is_adapter_weight(name: str) -> bool:
    """Whether a state-dict name is an adapter's A or B."""
    return name.rpartition(".")[2] in ADAPTER_NAMES
