"""Which tasks to run, and their results, through lm-evaluation-harness.

A task is named as the harness names it (`hellaswag`, a group, a tag), or by the path of a task YAML file;
`include_path` adds folders of YAML files. Forge's own tasks (engine/eval/tasks/) are always found. The
harness's index of its hundreds of built-in tasks takes seconds to build, so it is built only when a name is
not among Forge's and the included ones.

Offline first: a task whose data is local (Forge's, or a YAML with `dataset_path: json` and
`dataset_kwargs: {data_files: …}`) needs no network. A task whose data set is neither local nor in the
Hugging Face cache of an offline machine is refused with its data set's name and how to point it at files.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_eval import simple_evaluate
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager

from engine.errors import UserError
from engine.eval.evaluate import check_options
from engine.eval.split import ALONE, WorkSplit

FORGE_TASKS = Path(__file__).with_name("tasks")
YAML_SUFFIXES = (".yaml", ".yml")
LOCAL_DATA_HINT = (
    "on a machine with network, run the task once and copy its Hugging Face datasets cache (HF_DATASETS_CACHE) "
    "here; or write a task YAML with `dataset_path: json` and `dataset_kwargs: {data_files: {test: FILE.jsonl}}` "
    "and pass it with --tasks FILE.yaml or --include-path DIR"
)


@dataclass(frozen=True)
class MetricResult:
    """One number of one task: e.g. task forge_next_line, metric acc, filter none."""

    task: str
    metric: str
    filter: str
    value: float
    stderr: float | None

    @property
    def key(self) -> str:
        """How the number is logged: TASK/METRIC, with the filter when it is not the default one."""
        return f"{self.task}/{self.metric}" + ("" if self.filter == "none" else f",{self.filter}")


@dataclass(frozen=True)
class TaskRun:
    results: list[MetricResult]
    samples: dict[str, int]  # task → documents evaluated
    num_fewshot: dict[str, int]  # task → examples in each prompt
    raw: dict[str, Any]  # what simple_evaluate returned (with the per-request samples when asked for)


def task_manager(specs: list[str], include_path: list[Path]) -> TaskManager:
    """A manager that knows every name in `specs`: Forge's and the included tasks, and the harness's built-in
    ones only when needed. An unknown name is a UserError listing the closest known names."""
    for folder in include_path:
        if not folder.is_dir():
            raise UserError(f"--include-path {folder} is not a folder", "pass a folder holding task YAML files")
    quiet_harness()
    paths = [FORGE_TASKS, *include_path]
    names = [spec for spec in specs if not is_yaml_path(spec)]
    for spec in specs:
        if is_yaml_path(spec):
            check_task_file(Path(spec))
    manager = TaskManager(include_path=[str(p) for p in paths], include_defaults=False)
    if any(name not in manager.all_tasks for name in names):
        manager = TaskManager(include_path=[str(p) for p in paths])
    for name in names:
        if name not in manager.all_tasks:
            close = difflib.get_close_matches(name, manager.all_tasks, n=5, cutoff=0.6)
            raise UserError(
                f"unknown task {name!r}" + (f"; the closest names: {', '.join(close)}" if close else ""),
                "list the tasks with `lm-eval ls tasks`, pass a task YAML file, or add its folder with --include-path",
            )
    return manager


def is_yaml_path(spec: str) -> bool:
    """A spec naming a YAML file; one that does not exist is an error, not a task name."""
    if not spec.endswith(YAML_SUFFIXES):
        return False
    if not Path(spec).is_file():
        raise UserError(f"task file {spec} not found", "pass the path of a task YAML file, or a task name")
    return True


def check_task_file(path: Path) -> None:
    """A task YAML the harness can build a task from: YAML, a mapping (with its includes), and a task with a
    data set (`dataset_path`, or `custom_dataset`) or a group of tasks. Read as the harness reads it, but
    without importing its `!function`s; otherwise the harness fails with a parser error, a ValueError or a
    TypeError far from the file."""
    from lm_eval.tasks._yaml_loader import load_yaml  # the harness's own reader: the same includes and tags
    from yaml import YAMLError

    fix = (
        "a task YAML is a mapping with task:, dataset_path: (or custom_dataset:) and doc_to_text:, as in lm-eval's docs"
    )
    try:
        raw = load_yaml(path, resolve_func=False)
    except YAMLError as err:
        raise UserError(f"task file {path} is not YAML: {' '.join(str(err).split())}", fix) from None
    except (ValueError, OSError) as err:  # a list or a scalar, an include cycle, a missing included file
        raise UserError(f"task file {path} cannot be read as a task: {err}", fix) from None
    if "group" not in raw and not ({"dataset_path", "custom_dataset"} & raw.keys()):
        raise UserError(f"task file {path} names no data set (no dataset_path or custom_dataset)", fix)


def load_tasks(manager: TaskManager, specs: list[str]) -> list[Any]:
    """The harness's Task/Group objects, each loaded (its data read) here so that a data set that cannot be
    read is refused naming the task and the data set."""
    loaded = []
    for spec in specs:
        target = str(Path(spec).resolve()) if is_yaml_path(spec) else spec
        try:
            built = manager.load([target])
        except (ConnectionError, FileNotFoundError) as err:
            raise UserError(f"task {spec}: its data set cannot be read here ({err})", LOCAL_DATA_HINT) from None
        loaded += [*built["groups"].values()] or [*built["tasks"].values()]
    return loaded


def run_tasks(
    lm: LM,
    specs: list[str],
    num_fewshot: int | None = None,
    limit: int | None = None,
    include_path: list[Path] = (),
    log_samples: bool = False,
) -> TaskRun:
    """Evaluate `lm` on the tasks `specs` names. `limit`: the first N documents of each task."""
    if not specs:
        raise UserError("no task given", "e.g. --tasks forge_next_line")
    check_options(num_fewshot, limit)
    manager = task_manager(specs, list(include_path))
    return run_loaded(lm, manager, load_tasks(manager, specs), num_fewshot, limit, log_samples)


def run_loaded(
    lm: LM,
    manager: TaskManager,
    tasks: list[Any],
    num_fewshot: int | None,
    limit: int | None,
    log_samples: bool = False,
    split: WorkSplit = ALONE,
) -> TaskRun:
    """Evaluate `lm` on tasks `load_tasks` loaded. The stderr of a mean is the harness's closed form; only
    other aggregations bootstrap (1000 resamples: the third digit of a stderr, not the second, varies).
    Under a `split` (the processes sharing `lm`'s work, engine.eval.split) every process gets rank 0's results:
    the harness returns them only where LOCAL_RANK is 0; `raw` is rank 0's alone."""
    raw = simple_evaluate(
        model=lm,
        tasks=tasks,
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=log_samples,
        bootstrap_iters=1000,
    )
    first = split.from_first(None if raw is None else (metric_results(raw), samples(raw), fewshots(raw)))
    return TaskRun(*first, raw if split.rank == 0 else {})


def metric_results(raw: dict[str, Any]) -> list[MetricResult]:
    """The harness's results, one per (task, metric, filter); its "metric,filter" keys split, stderr beside."""
    rows = []
    for task, values in raw["results"].items():
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or "_stderr" in metric or not isinstance(value, int | float):
                continue
            stderr = values.get(f"{metric}_stderr,{filter_name}")
            rows.append(
                MetricResult(task, metric, filter_name, float(value), float(stderr) if is_number(stderr) else None)
            )
    return rows


def is_number(value: Any) -> bool:
    return isinstance(value, int | float)


def samples(raw: dict[str, Any]) -> dict[str, int]:
    return {task: int(n["effective"]) for task, n in raw["n-samples"].items()}


def fewshots(raw: dict[str, Any]) -> dict[str, int]:
    return {task: int(n) for task, n in raw.get("n-shot", {}).items() if is_number(n)}


def quiet_harness() -> None:
    """The harness logs every step at INFO/WARNING; the CLI shows its own progress and results."""
    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.ERROR)
