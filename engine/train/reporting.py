"""How the training loop tells the outside world what it is doing, without knowing who listens.

The CLI passes a `Reporter` that draws a dashboard or prints lines; library users can pass their own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class Reporter(Protocol):
    def on_start(self, info: dict[str, Any]) -> None: ...
    def on_log(self, step: int, metrics: dict[str, float]) -> None: ...
    def on_eval(self, step: int, metrics: dict[str, float]) -> None: ...
    def on_checkpoint(self, step: int, path: Path) -> None: ...
    def on_end(self, summary: dict[str, Any]) -> None: ...


class SilentReporter:
    """A reporter that ignores everything (library use, tests)."""

    def on_start(self, info: dict[str, Any]) -> None:
        pass

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def on_checkpoint(self, step: int, path: Path) -> None:
        pass

    def on_end(self, summary: dict[str, Any]) -> None:
        pass
