"""Downstream tasks during training (`eval.tasks`): every `eval.task_interval` steps and after the last, the
model is evaluated on the tasks as `forge eval` evaluates a checkpoint, and the results are logged as
`eval/TASK/METRIC` with the other metrics.

What is evaluated is a whole, plain copy of the model in fp32 on each process's device, built from the
training model's full state dict (gathered from its shards under FSDP, tensor, context or expert
parallelism): the model `forge eval` loads from a checkpoint of that step, so the numbers are the ones it
gives. The copy exists only during the evaluation; it costs up to two fp32 models' memory per process at its
peak when the training model is sharded (the gathered full weights, and the copy they are loaded into).
With several processes, each runs the harness on every request and computes its share of the forwards
(engine.eval.split): the same numbers as one process. Under pipeline parallelism, where no process holds the
whole model, and for LoRA runs, the config is refused (engine/eval/rules.py).

The tasks are found and their data read once, before the run directory is written: an unknown task or data
set an offline machine lacks stops the run before it starts.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from engine.config.job import JobConfig
from engine.config.model import ModelConfig
from engine.data.tokenizer import Encoder
from engine.errors import UserError
from engine.eval.evaluate import require_harness
from engine.eval.split import process_split
from engine.model import build_model


@dataclass
class TrainingTasks:
    """The tasks of `eval.tasks`, loaded, and how often and how much of them to evaluate."""

    cfg: JobConfig
    encoder: Encoder
    manager: Any  # lm_eval.tasks.TaskManager
    tasks: list[Any]  # the harness's loaded Task/Group objects

    @property
    def interval(self) -> int:
        e = self.cfg.eval
        return e.interval if e.task_interval is None else e.task_interval

    def due(self, step: int, max_steps: int) -> bool:
        return step % self.interval == 0 or step == max_steps

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """The tasks' metrics for `model` (the training model, as it is: call inside the optimizer's eval mode),
        keyed eval/TASK/METRIC. Collective: every process of the run calls it at the same step."""
        from engine.eval.harness import ForgeLM
        from engine.eval.suite import run_loaded

        e = self.cfg.eval
        split = process_split()
        with random_state_kept(device):  # the copy's init draws random numbers too, before its weights are loaded
            lm = ForgeLM(whole_model(model, self.cfg.model, device), self.encoder, e.task_batch_size, split=split)
            run = run_loaded(lm, self.manager, self.tasks, e.task_num_fewshot, e.task_limit, split=split)
        return {f"eval/{r.key}": r.value for r in run.results}


@contextlib.contextmanager
def random_state_kept(device: torch.device) -> Iterator[None]:
    """The harness seeds Python's, NumPy's and torch's global generators (as `forge eval` does, for the same
    numbers), and building the evaluated copy draws its initial weights from torch's; training goes on from
    the states they had, as if no evaluation had run."""
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type="cuda"):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


def open_tasks(cfg: JobConfig, tokenizer: Path | None) -> TrainingTasks | None:
    """The run's tasks, found and loaded (None without eval.tasks, or with eval.enabled = false); `tokenizer`:
    the tokenizer.json of the training data, which turns the tasks' text into the model's tokens."""
    e = cfg.eval
    if not (e.enabled and e.tasks):
        return None
    require_harness()
    if tokenizer is None or not tokenizer.is_file():
        raise UserError(
            "eval.tasks needs the tokenizer.json the training data was made with, and this data set has none",
            "tokenize the data with forge tokenize (which writes it), or leave eval.tasks empty",
        )
    os.environ.setdefault("TQDM_DISABLE", "1")  # the harness's progress bars, in every rank's log
    from engine.eval.suite import load_tasks, task_manager

    manager = task_manager(list(e.tasks), [])
    return TrainingTasks(cfg, Encoder.from_file(tokenizer), manager, load_tasks(manager, list(e.tasks)))


def whole_model(model: nn.Module, cfg: ModelConfig, device: torch.device) -> nn.Module:
    """A plain fp32 model with `model`'s weights on `device`, in eval mode, as engine.generate.load_model makes
    one from a checkpoint. Collective when `model` is sharded (every process gathers the full tensors)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    with torch.device(device):
        copy = build_model(cfg.model_copy(update={"sdpa_backend": "auto"}))
    copy.load_state_dict(state)
    return copy.eval()
