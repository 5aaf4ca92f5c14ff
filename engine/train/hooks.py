"""Extension points of training, of two kinds.

`TrainHooks` reach inside one step, for library users (inspecting or editing gradients, registering
forward hooks for one step, injecting faults in tests): passed to `engine.train.trainer.train`, every
method on every rank. The CLI passes none.

`TrainingHook` is the loop's call points, for research code named in the config without editing Forge:
`[[train.hooks]] {target = "package.module:Class", every = N, args = {...}}`. The class is built once per
process with `args` as keyword arguments, on the ranks its `ranks` attribute names, and called:

- `on_step_end(step, metrics, job)` after steps N, 2N, … (metrics: step, loss, grad_norm, lr, skipped);
- `on_eval(step, metrics, job)` after every evaluation (metrics: eval_loss, eval_perplexity, …);
- `on_checkpoint(step, path, job)` after a checkpoint is saved (an async save may still be writing);
- `on_run_end(step, metrics, job)` once the last step is done (metrics: the run's summary).

Within one step the order is on_eval, on_step_end, on_checkpoint. `step` counts from 1 as in the metrics; `job` is the `engine.train.job.Job` (model, optimizer, config, …).
A hook that raises stops the run on every rank: the trainer saves a checkpoint of the step first (unless it
has one), then raises `HookFailed` naming the hook (exit code 1 from `forge train`).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from engine.config.train import HookSpec
from engine.errors import ConfigError, ConfigIssue

if TYPE_CHECKING:
    from engine.train.job import Job

log = logging.getLogger("forge.train")


class TrainHooks:
    """Subclass and override what you need; each method runs on every rank."""

    def before_step(self, step: int, job: Job) -> None:
        """Before the first micro-batch of optimizer step `step`."""

    def after_backward(self, step: int, job: Job) -> None:
        """Gradients of step `step` are complete (still multiplied by the loss scale under fp16), before
        unscaling, clipping and the update."""


class TrainingHook:
    """Base of the hooks a config names; override the call points you need. `ranks = "main"` runs the hook
    on rank 0 only (logging, files), `"all"` on every rank (each sees its own shards of the weights)."""

    ranks: ClassVar[Literal["all", "main"]] = "main"

    def on_step_end(self, step: int, metrics: dict[str, Any], job: Job) -> None:
        """After optimizer step `step`, every `every` steps."""

    def on_eval(self, step: int, metrics: dict[str, Any], job: Job) -> None:
        """After the evaluation at step `step`."""

    def on_checkpoint(self, step: int, path: Path, job: Job) -> None:
        """After the checkpoint of step `step` was saved to (or, async, is being written to) `path`."""

    def on_run_end(self, step: int, metrics: dict[str, Any], job: Job) -> None:
        """After the last step, with the run's summary."""


class HookFailed(RuntimeError):
    """A config hook raised: the run stopped (after a checkpoint) on every rank."""


def hook_class(spec: HookSpec, index: int) -> type[TrainingHook]:
    """The class `spec.target` names, checked: it imports, subclasses TrainingHook, declares its ranks, and
    accepts `spec.args`. Any problem is a ConfigError naming the field (exit code 2, before training)."""
    field = f"train.hooks[{index}]"
    module_name, _, class_name = spec.target.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), class_name)
    except Exception as err:  # whatever importing research code raises
        raise hook_error(
            f"{field}.target", f"{spec.target!r} does not import: {err}", "put its package on PYTHONPATH"
        ) from None
    if not (isinstance(found, type) and issubclass(found, TrainingHook)):
        raise hook_error(f"{field}.target", f"{spec.target!r} is not a subclass of engine.train.hooks.TrainingHook", "")
    if found.ranks not in ("all", "main"):
        raise hook_error(f"{field}.target", f"{spec.target}.ranks must be 'all' or 'main', got {found.ranks!r}", "")
    try:
        inspect.signature(found).bind(**spec.args)
    except TypeError as err:
        raise hook_error(f"{field}.args", f"{spec.target} does not take these arguments: {err}", "") from None
    return found


def hook_error(path: str, problem: str, hint: str) -> ConfigError:
    return ConfigError([ConfigIssue(path, problem, hint or "see docs/training.md#hooks")])


@dataclass
class LoadedHook:
    name: str  # "train.hooks[0] (package.module:Class)"
    every: int
    hook: TrainingHook | None  # None on a rank the hook does not run on


class ConfigHooks:
    """The `[[train.hooks]]` of a run, built on the ranks they run on. Every rank calls the same call points
    at the same steps, and a failure on any rank is agreed on all of them, so that all stop together."""

    def __init__(self, specs: list[HookSpec], is_main: bool) -> None:
        classes = [hook_class(spec, i) for i, spec in enumerate(specs)]
        self.hooks = [LoadedHook(f"train.hooks[{i}] ({spec.target})", spec.every, None) for i, spec in enumerate(specs)]
        for loaded, spec, cls in zip(self.hooks, specs, classes):
            if cls.ranks == "all" or is_main:
                try:
                    loaded.hook = cls(**spec.args)
                except Exception as err:
                    raise HookFailed(f"hook {loaded.name} failed in __init__: {type(err).__name__}: {err}") from err

    def step_end(self, step: int, metrics: dict[str, Any], job: Job) -> None:
        due = [h for h in self.hooks if step % h.every == 0]
        if due:
            self.call(due, "on_step_end", step, metrics, job)

    def eval(self, step: int, metrics: dict[str, Any], job: Job) -> None:
        self.call(self.hooks, "on_eval", step, metrics, job)

    def checkpoint(self, step: int, path: Path, job: Job) -> None:
        self.call(self.hooks, "on_checkpoint", step, path, job)

    def run_end(self, step: int, metrics: dict[str, Any], job: Job) -> None:
        self.call(self.hooks, "on_run_end", step, metrics, job)

    def call(self, hooks: list[LoadedHook], point: str, step: int, payload: Any, job: Job) -> None:
        if not hooks:
            return
        from engine.resilience.collectives import any_rank  # here: validate-config loads hooks without torch

        failure = None
        for loaded in hooks:
            if loaded.hook is None:
                continue
            try:
                getattr(loaded.hook, point)(step, payload, job)
            except Exception as err:
                log.exception("hook %s failed in %s at step %d", loaded.name, point, step)
                failure = f"hook {loaded.name} failed in {point} at step {step}: {type(err).__name__}: {err}"
                break
        if any_rank(failure is not None, job.device):
            raise HookFailed(failure or f"a hook failed in {point} at step {step} on another rank")
