"""Small name → entry registries for the components a config picks by string.

Config fields are `Literal`s (so validation needs no torch); the entries register here when their module
is imported, and a test checks that every `Literal` option has one. Most entries are builders; a model
family registers its `ModelSpec` (engine/model/spec.py), an optimizer its builder in OPTIMIZERS (torch) and
its state size in OPTIMIZER_STATES (torch-free, read by the memory estimate).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._builders: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(builder: T) -> T:
            assert name not in self._builders, f"{self.kind} {name!r} registered twice"
            self._builders[name] = builder
            return builder

        return add

    def get(self, name: str) -> T:
        if name not in self._builders:
            close = difflib.get_close_matches(name, self._builders, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown {self.kind} {name!r}{hint} (known: {', '.join(sorted(self._builders))})")
        return self._builders[name]

    def names(self) -> list[str]:
        return sorted(self._builders)


NORMS: Registry = Registry("norm")
ACTIVATIONS: Registry = Registry("activation")
OPTIMIZERS: Registry = Registry("optimizer")
SCHEDULERS: Registry = Registry("scheduler")
LOSSES: Registry = Registry("loss")
MODELS: Registry = Registry("model type")
OPTIMIZER_STATES: Registry = Registry("optimizer")
ROUTERS: Registry = Registry("MoE router")
