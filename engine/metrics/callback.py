"""The metric sinks as loop callbacks: each sink (engine/metrics/trackers.py) gets every logged record.

A sink that must find its own again in a resumed run (W&B's run, so the resumed attempt logs into the same
run) offers `state_dict()`; the checkpoint keeps it under the sink's `name`, as any callback's state. The
W&B sink needs its run id when it is built, before the loop starts, so the run directory reads it from the
restored states (`saved_wandb_run_id`) rather than through `load_state_dict`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from engine.metrics.trackers import Sink
from engine.train.callbacks.base import PRIORITY, Callback

if TYPE_CHECKING:
    from engine.train.trainer import TrainLoop

WANDB = "wandb"  # the W&B sink's name in METRICS_SINKS (engine/metrics/sinks.py): the key of its state
LEGACY_WANDB_RUN_ID = "wandb_run_id"  # where checkpoints written before callbacks kept state held the run id


class SinkCallback(Callback):
    """Rank 0's sinks, each one callback; writing a record is the run's own work (a full disk stops it as before)."""

    priority = PRIORITY["sinks"]
    ranks = "main"
    failure_saves = False

    def __init__(self, name: str, sink: Sink) -> None:
        self.sink_name, self.sink = name, sink

    @property
    def label(self) -> str:
        """Its name in METRICS_SINKS (one registry: the sink's registration is its callback's name)."""
        return self.sink_name

    def on_metrics(self, step: int, metrics: dict[str, Any], kind: str, loop: TrainLoop) -> None:
        self.sink.log(step, metrics)

    def state_dict(self) -> dict[str, Any] | None:
        keeps = getattr(self.sink, "state_dict", None)
        return keeps() if keeps is not None else None


def with_legacy_states(train_state: Mapping[str, Any]) -> dict[str, Any]:
    """The callbacks' states of a checkpoint's train state; one written before callbacks kept state has the
    W&B run id at the top level, and it becomes the W&B sink's state."""
    states = dict(train_state.get("callbacks", {}))
    if train_state.get(LEGACY_WANDB_RUN_ID) and WANDB not in states:
        states[WANDB] = {"run_id": train_state[LEGACY_WANDB_RUN_ID]}
    return states


def saved_wandb_run_id(states: Mapping[str, Any]) -> str | None:
    """The W&B run a resumed run continues, from its checkpoint's callback states (None: a new W&B run)."""
    return states.get(WANDB, {}).get("run_id")
