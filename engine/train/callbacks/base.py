"""What observes or extends the training loop: one interface, `Callback`, with named events and an order.

The loop (engine/train/trainer.py) is the step and these events; everything else it does (evaluation,
in-loop tasks, checkpointing and the preemption save, LoRA merging, the EMA, profiling, the collective
health check, the metric sinks, the CLI's dashboard, `[[train.hooks]]`) is a callback. A library user
passes their own to `engine.train.trainer.train(cfg, run_dir, callbacks=[...])` (docs/training.md#callbacks).

Per optimizer step the events come in this order:

    before_step              before the first micro-batch
    before_optimizer_step    the gradients are complete and reduced over the data-parallel ranks (still
                             multiplied by the loss scale under fp16), before unscaling, clipping and the update
    after_optimizer_step     the update is applied (or the bad step skipped): the weights are the step's
    on_metrics               the step's metrics, on a logging step (and whatever a callback logs)
    on_eval_due              the step is an evaluation step (eval.interval, and the last step)
    after_step               the step is done, its evaluation included
    on_checkpoint_due        the step is a checkpoint step (checkpoint.interval, …)
    on_preempted             a stop signal arrived: the run saves and stops after this

and around them `on_start` once before the first step, `on_end` once after the last;
`on_checkpoint_saved` when a checkpoint was saved (an async one may still be writing), and
`on_checkpoint_written` when it is complete on disk. Within an event, callbacks run by `priority`, highest
first (ties: in the order given); the engine's own take the priorities in `PRIORITY`.

`loop` (an `engine.train.trainer.TrainLoop`) gives `loop.job` (model, optimizer, config, …),
`loop.progress` (tokens seen, the latest metrics), `loop.info` (what the run starts with) and
`loop.log(step, metrics, kind)`, which sends metrics to every sink and console (`on_metrics`).

A callback that keeps state across attempts returns it from `state_dict()` (JSON: numbers, strings,
lists, dicts); the checkpoint keeps it in its train state under the callback's `name` (rank 0's), and a
resumed run hands it to `load_state_dict` before the first event.

A callback that raises (with `failure_saves`, the default) stops the run on every rank as a failing
`[[train.hooks]]` hook does: a step is saved (unless it is), and `CallbackFailed` names the callback, the
event and the error. Every rank learns of it in a step's one sync, at no extra cost: a failure inside step N
(before_step, before_optimizer_step) stops the run after step N's `after_step`, one later in the step (or
at the end of the run) after step N + 1's; the checkpoint holds that whole step, its metrics logged. The engine's own callbacks set `failure_saves = False`:
their errors (a checkpoint that cannot be written, a rank that stopped answering) are the run's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    from engine.train.step import StepResult
    from engine.train.trainer import TrainLoop

# The engine's callbacks' places in each event's order (higher first). A user's callback (0 by default)
# runs after all of them but the console's, the config hooks' and the health check's.
PRIORITY = {
    "profiling": 100,  # its window holds the step alone
    "ema": 95,  # averages the step's weights before anything changes them
    "lora_merge": 90,
    "checkpointing": 80,
    "eval": 70,
    "tasks": 60,
    "sinks": 50,
    "console": -10,
    "config_hooks": -20,
    "health": -30,
}

EVENTS = (
    "on_start",
    "before_step",
    "before_optimizer_step",
    "after_optimizer_step",
    "on_metrics",
    "on_eval_due",
    "after_step",
    "on_checkpoint_due",
    "on_checkpoint_saved",
    "on_checkpoint_written",
    "on_preempted",
    "on_end",
)


class CallbackFailed(RuntimeError):
    """A callback raised: the run stopped (after a checkpoint) on every rank."""


class Callback:
    """Subclass and override the events you need; each runs on the ranks `ranks` names."""

    name: ClassVar[str] = ""  # the key of its state in a checkpoint, and how failures name it; default: the class's
    priority: ClassVar[int] = 0
    ranks: ClassVar[Literal["all", "main"]] = "all"  # "main": rank 0 only (files, consoles)
    failure_saves: ClassVar[bool] = True

    @property
    def label(self) -> str:
        return self.name or type(self).__name__

    def on_start(self, loop: TrainLoop) -> None:
        """Once, before the first step of this attempt (a resumed run's state is already loaded)."""

    def before_step(self, step: int, loop: TrainLoop) -> None:
        """Before the first micro-batch of optimizer step `step` (counting from 1)."""

    def before_optimizer_step(self, step: int, loop: TrainLoop) -> None:
        """The gradients of step `step` are complete and reduced, before unscaling, clipping and the update."""

    def after_optimizer_step(self, step: int, result: StepResult, loop: TrainLoop) -> None:
        """The update of step `step` is applied (`result.problem is None`) or the step was skipped."""

    def on_metrics(self, step: int, metrics: dict[str, Any], kind: str, loop: TrainLoop) -> None:
        """Metrics logged at step `step`: `kind` is "train" (a logging step), "eval", "tasks", or what the
        callback that logged them called them."""

    def on_eval_due(self, step: int, loop: TrainLoop) -> None:
        """Step `step` is an evaluation step."""

    def after_step(self, step: int, result: StepResult, loop: TrainLoop) -> None:
        """Step `step` is done, its logging and evaluation included, before its checkpoint."""

    def on_checkpoint_due(self, step: int, loop: TrainLoop) -> None:
        """Step `step` is a checkpoint step."""

    def on_checkpoint_saved(self, step: int, path: Path, loop: TrainLoop) -> None:
        """The checkpoint of step `step` was saved to `path` (an async save may still be writing it)."""

    def on_checkpoint_written(self, step: int, path: Path, loop: TrainLoop) -> None:
        """The checkpoint of step `step` is complete in `path`."""

    def on_preempted(self, step: int, loop: TrainLoop) -> None:
        """A stop signal arrived by step `step`: the run saves it and stops after this event."""

    def on_end(self, summary: dict[str, Any], loop: TrainLoop) -> None:
        """Once, after the last step, with the run's summary."""

    def state_dict(self) -> dict[str, Any] | None:
        """What a resumed run needs of this callback (JSON), or None when it keeps nothing."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The state `state_dict` returned when the checkpoint a run resumes from was saved."""

    def overrides(self, event: str) -> bool:
        return getattr(type(self), event) is not getattr(Callback, event)
