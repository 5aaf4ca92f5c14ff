"""`[[train.hooks]]`: research code named in the config, called at the loop's call points without editing
Forge: `[[train.hooks]] {target = "package.module:Class", every = N, args = {...}}`. The class (a
`TrainingHook`) is built once per process with `args` as keyword arguments, on the ranks its `ranks`
attribute names, and called:

- `on_step_end(step, metrics, job)` after steps N, 2N, … (metrics: step, loss, grad_norm, lr, skipped);
- `on_eval(step, metrics, job)` after every evaluation (metrics: eval_loss, eval_perplexity, …);
- `on_checkpoint(step, path, job)` after a checkpoint is saved (an async save may still be writing);
- `on_run_end(step, metrics, job)` once the last step is done (metrics: the run's summary).

Within one step the order is on_eval, on_step_end, on_checkpoint. `step` counts from 1 as in the metrics; `job` is the `engine.train.job.Job` (model, optimizer, config, …).
A hook that raises stops the run on every rank: the trainer saves a checkpoint of the step first (unless it
has one), then raises `HookFailed` naming the hook (exit code 1 from `forge train`).

All of a run's hooks are one loop callback, `ConfigHooks` (engine/train/callbacks/base.py); library code
that can pass objects subclasses `Callback` itself.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import sys
from dataclasses import dataclass
from importlib.machinery import PathFinder
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from engine.config.train import HookSpec
from engine.errors import ConfigError, ConfigIssue
from engine.run_files import enclosing_run_dir
from engine.safe_paths import resolves_inside
from engine.train.callbacks.base import PRIORITY, Callback, CallbackFailed

if TYPE_CHECKING:
    from engine.train.job import Job
    from engine.train.step import StepResult
    from engine.train.trainer import TrainLoop

log = logging.getLogger("forge.train")


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


class HookFailed(CallbackFailed):
    """A config hook raised: the run stopped (after a checkpoint) on every rank."""


def hook_class(
    spec: HookSpec, index: int, run_dir: Path | None = None, allow_run_dir_code: bool = False
) -> type[TrainingHook]:
    """The class `spec.target` names, checked: it imports, subclasses TrainingHook, declares its ranks, and
    accepts `spec.args`. Any problem is a ConfigError naming the field (exit code 2, before training).

    Before anything is imported, the module is located without running it (`check_hook_module`): one that
    would be read from a run directory (`run_dir`, or any folder forge train wrote, e.g. the working directory
    `python -m` puts first on sys.path) is refused unless `allow_run_dir_code` (--allow-code): a run
    directory handed over by someone else must not run code by being trained in or from."""
    field = f"train.hooks[{index}]"
    module_name, _, class_name = spec.target.partition(":")
    check_hook_module(spec, index, run_dir, allow_run_dir_code)
    try:
        found = getattr(importlib.import_module(module_name), class_name)
    except Exception as err:  # whatever importing research code raises
        raise hook_error(f"{field}.target", f"{spec.target!r} does not import: {err}", PATH_HINT) from None
    if not (isinstance(found, type) and issubclass(found, TrainingHook)):
        raise hook_error(f"{field}.target", f"{spec.target!r} is not a subclass of engine.train.hooks.TrainingHook", "")
    if found.ranks not in ("all", "main"):
        raise hook_error(f"{field}.target", f"{spec.target}.ranks must be 'all' or 'main', got {found.ranks!r}", "")
    try:
        inspect.signature(found).bind(**spec.args)
    except TypeError as err:
        raise hook_error(f"{field}.args", f"{spec.target} does not take these arguments: {err}", "") from None
    return found


def check_hook_module(spec: HookSpec, index: int, run_dir: Path | None, allow_run_dir_code: bool) -> None:
    """The module of `spec.target` can be found, and (unless allowed) none of its files, nor those of the
    packages above it, lies in a run directory. Runs no code of it: `forge validate-config` calls this alone."""
    module_name = spec.target.partition(":")[0]
    field = f"train.hooks[{index}].target"
    locations = module_files(module_name)
    if locations is None:
        raise hook_error(field, f"{spec.target!r} does not import: no module named {module_name!r}", PATH_HINT)
    if allow_run_dir_code:
        return
    for location in locations:
        found = run_dir if run_dir is not None and resolves_inside(location, run_dir) else enclosing_run_dir(location)
        if found is not None:
            raise hook_error(
                field,
                f"{spec.target!r} would be imported from {location}, inside the run directory {found}: code in a "
                "run directory runs only when asked for",
                "pass --allow-code if you trust that run directory, or put the hook's package on PYTHONPATH outside it",
            )


PATH_HINT = "put its package on PYTHONPATH"


def module_files(module_name: str) -> list[Path] | None:
    """The files and folders importing `module_name` would read code from (each package on the way, then the
    module), found without importing anything: the top-level name through every finder on sys.meta_path
    (which runs no module code), the names below it in their parent's folders. None when it cannot be found;
    [] for a module already imported, or built in."""
    if module_name in sys.modules:
        return []
    parts = module_name.split(".")
    try:
        found = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return None
    files: list[Path] = []
    for depth in range(1, len(parts) + 1):
        if found is None:
            return None
        if found.has_location and found.origin:
            files.append(Path(found.origin))
        folders = list(found.submodule_search_locations or [])
        files += [Path(folder) for folder in folders]
        if depth < len(parts):
            found = PathFinder.find_spec(".".join(parts[: depth + 1]), folders) if folders else None
    return files


def hook_error(path: str, problem: str, hint: str) -> ConfigError:
    return ConfigError([ConfigIssue(path, problem, hint or "see docs/training.md#hooks")])


@dataclass
class LoadedHook:
    name: str  # "train.hooks[0] (package.module:Class)"
    every: int
    hook: TrainingHook | None  # None on a rank the hook does not run on


class ConfigHooks(Callback):
    """The `[[train.hooks]]` of a run, built on the ranks they run on: one callback. Every rank calls the
    same call points at the same steps, and a failure on any rank is agreed on all of them (when a hook was
    due), so that all stop together with `HookFailed`."""

    name = "config_hooks"
    priority = PRIORITY["config_hooks"]
    failure_saves = False  # agreed here, only at the steps a hook is due: HookFailed is a CallbackFailed

    def __init__(
        self, specs: list[HookSpec], is_main: bool, run_dir: Path | None = None, allow_run_dir_code: bool = False
    ) -> None:
        classes = [hook_class(spec, i, run_dir, allow_run_dir_code) for i, spec in enumerate(specs)]
        self.hooks = [LoadedHook(f"train.hooks[{i}] ({spec.target})", spec.every, None) for i, spec in enumerate(specs)]
        for loaded, spec, cls in zip(self.hooks, specs, classes):
            if cls.ranks == "all" or is_main:
                try:
                    loaded.hook = cls(**spec.args)
                except Exception as err:
                    raise HookFailed(f"hook {loaded.name} failed in __init__: {type(err).__name__}: {err}") from err

    def after_step(self, step: int, result: StepResult, loop: TrainLoop) -> None:
        self.step_end(step, result.as_metrics(step), loop.job)

    def on_metrics(self, step: int, metrics: dict[str, Any], kind: str, loop: TrainLoop) -> None:
        if kind == "eval":
            self.eval(step, metrics, loop.job)

    def on_checkpoint_saved(self, step: int, path: Path, loop: TrainLoop) -> None:
        self.checkpoint(step, path, loop.job)

    def on_end(self, summary: dict[str, Any], loop: TrainLoop) -> None:
        self.run_end(summary["steps"], summary, loop.job)

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
