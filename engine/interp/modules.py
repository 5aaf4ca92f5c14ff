"""Which modules of the single-device model can be read out, and their output shapes.

A module can be extracted when it runs in the forward (a `ModuleDict` such as `layers` never does) and its
output — or the first item of the tuple it returns (a block returns `(hidden, moe_stats)`) — is a tensor laid
out (batch, seq, …): one row of features per token. Rather than trusting a hand-kept list, a short probe
forward with a hook on every module records what each one returns, so a new module type is extractable the
day it is added. The probe runs twice at different lengths so that a (batch, heads, seq, …) tensor such as
`attention.core`'s output is not mistaken for a per-token one.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import UserError

PROBE_LENGTHS = (3, 5)


@dataclass(frozen=True)
class ModuleOutput:
    """What one module returns per token: `features` values of `dtype` (None when it is not per-token, with
    the reason in `problem`)."""

    name: str
    shape: tuple[int, ...] | None  # per token, after (batch, seq)
    dtype: torch.dtype | None
    problem: str = ""

    @property
    def features(self) -> int:
        return int(torch.Size(self.shape).numel()) if self.shape is not None else 0


def first_tensor(output: object) -> torch.Tensor | None:
    """The tensor a module gives: its output, or the first item of a tuple it returns."""
    if isinstance(output, tuple) and output:
        output = output[0]
    return output if isinstance(output, torch.Tensor) else None


@torch.no_grad()
def probe_outputs(model: nn.Module) -> dict[str, ModuleOutput]:
    """Name → what it returns, for every named module of `model`, in the order of `named_modules`."""
    seen: dict[int, dict[str, object]] = {}
    names = [name for name, _ in model.named_modules() if name]
    modules = dict(model.named_modules())
    device = next(model.parameters()).device
    for length in PROBE_LENGTHS:
        outputs: dict[str, object] = {}
        handles = [modules[name].register_forward_hook(keep_first(outputs, name)) for name in names]
        try:
            model(torch.zeros(2, length, dtype=torch.long, device=device))
        finally:
            for handle in handles:
                handle.remove()
        seen[length] = outputs
    return {name: describe(name, [seen[length].get(name) for length in PROBE_LENGTHS]) for name in names}


def keep_first(outputs: dict[str, object], name: str) -> Callable:
    """A hook that records what `name` returns the first time it runs."""
    return lambda _module, _args, out: outputs.setdefault(name, out)


def describe(name: str, outputs: Sequence[object]) -> ModuleOutput:
    short, long = outputs
    if short is None:
        return ModuleOutput(name, None, None, "it is a container that the forward never calls")
    a, b = first_tensor(short), first_tensor(long)
    if a is None or b is None:
        return ModuleOutput(name, None, None, f"its output is a {type(short).__name__}, not a tensor")
    per_token = a.ndim >= 2 and a.shape[:2] == (2, PROBE_LENGTHS[0]) and b.shape[:2] == (2, PROBE_LENGTHS[1])
    if not per_token or a.shape[2:] != b.shape[2:]:
        return ModuleOutput(name, None, None, f"its output {tuple(a.shape)} is not laid out (batch, seq, …)")
    return ModuleOutput(name, tuple(a.shape[2:]), a.dtype)


def resolve_layers(patterns: Sequence[str], outputs: dict[str, ModuleOutput]) -> list[str]:
    """The module names the patterns (names, or globs whose `*` stays within one dotted segment) match, in model order, each once. A pattern that
    matches nothing, or only modules without a per-token tensor output, is a UserError naming the valid names."""
    if not patterns:
        raise UserError("no --layers given", "name modules or globs, e.g. --layers 'layers.*' (see --list-layers)")
    valid = [name for name, out in outputs.items() if out.shape is not None]
    chosen: set[str] = set()
    for pattern in patterns:
        matched = [name for name in outputs if matches(name, pattern)]
        usable = [name for name in matched if outputs[name].shape is not None]
        if not matched:
            raise UserError(
                f"--layers {pattern!r} matches no module of the model",
                f"valid names: {summarize(valid)} (forge extract RUN --list-layers lists them with shapes)",
            )
        if not usable:
            raise UserError(
                f"--layers {pattern!r} matches {matched[0]!r}, which cannot be extracted: {outputs[matched[0]].problem}",
                f"pick modules with a per-token tensor output: {summarize(valid)}",
            )
        chosen.update(usable)
    return [name for name in outputs if name in chosen]


def matches(name: str, pattern: str) -> bool:
    """Glob matching per dotted segment: `layers.*` is the blocks, not every module inside them, and
    `layers.*.attention` each block's attention."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, wanted))


def summarize(names: Sequence[str], limit: int = 24) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", … ({len(names) - limit} more)" if len(names) > limit else "")
