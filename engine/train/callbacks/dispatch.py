"""Calling the loop's callbacks: in their order, on the ranks they run on, failures agreed by every rank."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from engine.resilience.collectives import any_rank
from engine.train.callbacks.base import Callback, CallbackFailed

log = logging.getLogger("forge.train")


class Callbacks:
    """A run's callbacks, sorted by priority (stable). Every rank holds the same list and calls the same
    events at the same steps; each callback runs where its `ranks` say.

    A failure-saving callback that raises is logged and recorded, and the rest of that event skipped. Every
    rank learns of a failure on any rank in the next step's sync, which carries the vote at no cost
    (engine.train.step.step_totals), and all raise `CallbackFailed` together (`raise_failure`, once the step's
    events up to `after_step` are done, so that the step saved is whole, logs included): a failure inside step
    N (before_step, before_optimizer_step) stops at step N, one after its sync at step N + 1. At
    the points no step follows (a preemption, the end) `settle` asks the ranks itself (one all-reduce, only
    when failure-saving callbacks exist). A callback that is not failure-saving raises through at once (the
    engine's own errors, and the config hooks' `HookFailed`, which they agree themselves)."""

    def __init__(self, callbacks: Iterable[Callback], is_main: bool, device: torch.device) -> None:
        self.all = sorted(callbacks, key=lambda c: -c.priority)
        labels = [c.label for c in self.all]
        repeated = sorted({label for label in labels if labels.count(label) > 1})
        if repeated:
            raise ValueError(f"two callbacks are named {', '.join(repeated)}: give each a `name` of its own")
        self.here = [c for c in self.all if c.ranks == "all" or is_main]
        self.device = device
        self.agrees = any(c.failure_saves for c in self.all)
        self.failure: str | None = None

    def load_states(self, states: dict[str, Any]) -> None:
        """Give each callback the state its checkpoint saved under its name (a resumed run)."""
        for callback in self.here:
            if callback.label in states:
                callback.load_state_dict(states[callback.label])

    def states(self) -> dict[str, Any]:
        """What the checkpoint keeps of the callbacks, by name."""
        kept = ((c.label, c.state_dict()) for c in self.here)
        return {label: state for label, state in kept if state is not None}

    def emit(self, event: str, step: int, *args: Any) -> None:
        """Call `event(*args)` on every callback here; `step` is where a failure happened."""
        for callback in self.here:
            if not callback.failure_saves:
                getattr(callback, event)(*args)
                continue
            try:
                getattr(callback, event)(*args)
            except Exception as err:  # whatever research code raises
                log.exception("callback %s failed in %s at step %d", callback.label, event, step)
                if self.failure is None:
                    self.failure = (
                        f"callback {callback.label} failed in {event} at step {step}: {type(err).__name__}: {err}"
                    )
                return

    def raise_failure(self, step: int, anywhere: bool) -> None:
        """Raise `CallbackFailed` if a callback failed on some rank (`anywhere`, agreed by every rank)."""
        if anywhere:
            raise CallbackFailed(self.failure or f"a callback failed by step {step} on another rank")

    def settle(self, step: int) -> None:
        """`raise_failure`, asking the ranks whether one failed (where no step's sync follows)."""
        if self.agrees:
            self.raise_failure(step, any_rank(self.failure is not None, self.device))
