"""Extension points inside the training step, for library users: inspecting or editing gradients,
registering forward hooks for one step, injecting faults in tests. The CLI passes none."""

from __future__ import annotations

from engine.train.job import Job


class TrainHooks:
    """Subclass and override what you need; each method runs on every rank."""

    def before_step(self, step: int, job: Job) -> None:
        """Before the first micro-batch of optimizer step `step`."""

    def after_backward(self, step: int, job: Job) -> None:
        """Gradients of step `step` are complete (still multiplied by the loss scale under fp16), before
        unscaling, clipping and the update."""
