"""What a config asking for downstream tasks during training (`eval.tasks`) needs, checked without torch or
lm-eval: the harness installed (found, not imported), and a layout where every process can hold the whole
model (engine/eval/in_training.py builds one copy per process and the processes share the requests)."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config.fields import changed_fields
from engine.errors import ConfigIssue

if TYPE_CHECKING:
    from engine.config.job import JobConfig

YAML_SUFFIXES = (".yaml", ".yml")
INSTALL_HINT = "pip install 'forge-lm[eval]' (or pip install lm-eval), or leave eval.tasks empty"
TASK_FIELDS = ("task_interval", "task_limit", "task_num_fewshot", "task_batch_size")  # read only with eval.tasks


def harness_installed() -> bool:
    """Whether lm-evaluation-harness can be imported, without importing it (seconds, and torch)."""
    return find_spec("lm_eval") is not None


def task_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """eval.tasks runs only where it computes what `forge eval` computes; anywhere else it is refused with why.
    The eval.task_* settings are read only with eval.tasks: set without it, nothing would read them."""
    e = cfg.eval
    if not e.tasks:
        return [
            ConfigIssue(
                f"eval.{field}", "is set, but eval.tasks is empty, so nothing reads it", "remove it, or set eval.tasks"
            )
            for field in changed_fields(e, TASK_FIELDS)
        ]
    if not e.enabled:
        return []
    issues = []
    if not harness_installed():
        issues.append(
            ConfigIssue("eval.tasks", "needs lm-evaluation-harness (lm_eval), which is not installed", INSTALL_HINT)
        )
    for spec in e.tasks:
        if spec.endswith(YAML_SUFFIXES) and not Path(spec).is_file():
            issues.append(ConfigIssue("eval.tasks", f"task file {spec} not found", "pass the path of a task YAML file"))
    if cfg.distributed.pp > 1:
        issues.append(
            ConfigIssue(
                "eval.tasks",
                f"tasks are not evaluated under pipeline parallelism (distributed.pp = {cfg.distributed.pp}): each "
                "process holds only its stages, and the tasks need the whole model in every process",
                "evaluate the checkpoints with forge eval RUN --tasks … --nproc-per-node N, or leave eval.tasks empty",
            )
        )
    if cfg.lora.enabled:
        issues.append(
            ConfigIssue(
                "eval.tasks",
                "tasks are not evaluated during a LoRA run: its adapters would have to be merged into a copy of the "
                "base at every evaluation",
                "evaluate the checkpoints with forge eval (which merges the adapters), or leave eval.tasks empty",
            )
        )
    return issues
