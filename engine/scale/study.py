"""A scaling study's runs, read for a fit: each finished run's final held-out loss with its N, D and C, the
checks that the runs belong together, and the fits and prediction made from them. Torch-free.

N is every parameter (validate-config's total); D the tokens the run trained on; C Forge's count of its
training FLOPs (FLOPs per token, attention included, × D), with 6·N·D beside it. The loss is the held-out
loss evaluated at the run's last step.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.config.job import JobConfig
from engine.config.loader import load_job_config
from engine.data.batch_plan import tokens_per_step
from engine.errors import UserError
from engine.model.estimate import param_counts, training_flops_per_token
from engine.run_files import METRICS_FILE, RUN_CONFIG
from engine.runs import metric_records, run_config, summarize_run
from engine.scale.family import check_scalable, family_fields
from engine.scale.fit import MIN_RUNS, approach2, approach3, check_enough

# [data] fields that say how batches are loaded, not what they hold (and the tokenizer, compared on its own).
LOADER_FIELDS = ("num_workers", "pin_memory", "prefetch_factor", "tokenizer_path")  # the last: see `tokenizer`
EVAL_SOURCE_FIELDS = (
    "dataset_path",
    "file_pattern",
    "hf_dataset_name",
    "hf_dataset_config",
    "hf_dataset_split",
    "hf_dataset_revision",
)


@dataclass
class RunPoint:
    name: str
    path: str
    params: int
    tokens: int
    flops: float  # Forge's count
    flops_6nd: float
    loss: float  # held-out loss at the last step


@dataclass
class Unfinished:
    name: str
    path: str
    status: str
    detail: str


def read_run(run_dir: Path) -> RunPoint | Unfinished:
    """A finished run's point, or why it is not finished. A finished run without a held-out loss at its last
    step is a user error: it cannot be part of a fit, and nothing will make it one."""
    summary = summarize_run(run_dir, str(run_dir))
    if summary.status != "complete" or summary.step != summary.max_steps:
        progress = f"step {summary.step or 0} of {summary.max_steps}"
        return Unfinished(run_dir.name, str(run_dir), summary.status, f"{progress}; {summary.detail}".strip("; "))
    cfg = load_job_config(run_dir / RUN_CONFIG)
    records = metric_records(run_dir)
    final = [r for r in records if "eval_loss" in r and r["step"] == summary.max_steps]
    if not final:
        raise UserError(
            f"{run_dir} finished without a held-out loss at its last step (step {summary.max_steps})",
            "train the study's runs with eval.enabled = true (`forge scale plan` sets it)",
        )
    check_scalable(cfg.model)
    loss = measured(run_dir, "eval_loss", final[-1]["eval_loss"], float)
    tokens = measured(
        run_dir, "tokens_seen", next((r["tokens_seen"] for r in reversed(records) if "tokens_seen" in r), None), int
    )
    params = param_counts(cfg.model)["total"]
    flops = float(training_flops_per_token(cfg.model, cfg.train.seq_len) * tokens)
    return RunPoint(run_dir.name, str(run_dir), params, tokens, flops, 6.0 * params * tokens, loss)


def measured(run_dir: Path, key: str, value: Any, kind: type) -> Any:
    """A final loss or token count of a run's metrics, which the fits take logarithms of: a positive, finite
    number (an int for a count). Anything else (a diverged run's NaN, a hand-edited or damaged metrics.jsonl)
    is a user error naming the run, rather than a fit that fails deep in SciPy or fits nonsense."""
    number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not number or (kind is int and not isinstance(value, int)):
        what = "a positive whole number" if kind is int else "a positive, finite number"
        raise UserError(
            f"{run_dir / METRICS_FILE}: the final {key} is {json.dumps(value)}, not {what}",
            "leave this run out of the fit (a diverged run has no usable loss), or train it again",
        )
    return kind(value)


def signatures(run_dir: Path) -> dict[str, dict[str, Any]]:
    """What must be the same across a study's runs: its data (training and held-out sources, sequence length),
    its tokenizer, and its family (the [model] fields the family rule does not scale)."""
    raw = run_config(run_dir)
    data = {f"data.{k}": v for k, v in raw.get("data", {}).items() if k not in LOADER_FIELDS}
    data |= {f"eval.{k}": raw.get("eval", {}).get(k) for k in EVAL_SOURCE_FIELDS}
    data["train.seq_len"] = raw.get("train", {}).get("seq_len")
    tokenizer_file = run_dir / "tokenizer.json"
    tokenizer = {
        "tokenizer.json": hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()[:16]
        if tokenizer_file.is_file()
        else None,
        "data.tokenizer_path": raw.get("data", {}).get("tokenizer_path"),
    }
    family = {f"model.{k}": v for k, v in family_fields(raw.get("model", {})).items()}
    return {"data": data, "tokenizer": tokenizer, "family": family}


def check_same_study(run_dirs: list[Path]) -> None:
    """Every run shares the data, tokenizer and family of the most common one; the first that does not is
    named with the fields that differ."""
    signed = [(run, signatures(run)) for run in run_dirs]
    for kind in ("data", "tokenizer", "family") if signed else ():  # no runs started: check_enough says so
        keys = [json.dumps(s[kind], sort_keys=True, default=str) for _, s in signed]
        common, _ = Counter(keys).most_common(1)[0]
        reference = next(s[kind] for (_, s), key in zip(signed, keys) if key == common)
        for (run, sig), key in zip(signed, keys):
            if key != common:
                fields = sorted(k for k in reference.keys() | sig[kind].keys() if reference.get(k) != sig[kind].get(k))
                shown = ", ".join(f"{k} = {sig[kind].get(k)!r} (others: {reference.get(k)!r})" for k in fields)
                raise UserError(
                    f"{run} has a different {kind} from the other runs: {shown}",
                    "fit only runs of one study: same data, tokenizer and model family",
                )


def expand(args: list[Path]) -> tuple[list[Path], list[Unfinished]]:
    """The run directories named, a plan folder standing for its points' runs; and the runs that have not
    started (a plan's point without a run yet, or a run directory a SLURM submission made that training has
    not written to)."""
    from engine.scale.plan import PLAN_FILE, read_plan
    from engine.slurm.jobs import SLURM_DIR

    runs: list[Path] = []
    planned: set[Path] = set()
    for arg in args:
        if (arg / PLAN_FILE).is_file():
            planned |= {arg / p.run_dir for p in read_plan(arg).points}
            runs += [arg / p.run_dir for p in read_plan(arg).points]
        else:
            runs.append(arg)
    if len(set(runs)) != len(runs):
        raise UserError("a run directory is given twice", "pass each run (or plan folder) once")
    started, waiting = [], []
    for run in runs:
        if (run / RUN_CONFIG).is_file():
            started.append(run)
        elif run in planned or (run / SLURM_DIR).is_dir():
            waiting.append(Unfinished(run.name, str(run), "not started", "no run yet"))
        else:
            raise UserError(f"{run} is not a run directory (no {RUN_CONFIG})", "pass the runs of the study")
    return started, waiting


def collect(args: list[Path], strict: bool) -> tuple[list[RunPoint], list[Unfinished]]:
    """The finished runs' points and the unfinished runs (an error with `strict`)."""
    run_dirs, unfinished = expand(args)
    check_same_study(run_dirs)
    read = [read_run(run) for run in run_dirs]
    points = [r for r in read if isinstance(r, RunPoint)]
    unfinished += [r for r in read if isinstance(r, Unfinished)]
    if strict and unfinished:
        raise UserError(
            f"--strict: {len(unfinished)} run(s) have not finished: {listed(unfinished)}",
            "finish them, or drop --strict",
        )
    if unfinished and len(points) < MIN_RUNS:  # the runs to wait for are the answer, so they are named
        raise UserError(
            f"a scaling fit needs at least {MIN_RUNS} finished runs; got {len(points)}, and "
            f"{len(unfinished)} run(s) have not finished: {listed(unfinished)}",
            "finish them (`forge scale run PLAN_DIR` trains or continues a plan's runs), then fit again",
        )
    check_enough(len(points))
    return points, unfinished


def listed(unfinished: list[Unfinished]) -> str:
    return "; ".join(f"{u.path} ({u.status}: {u.detail})" for u in unfinished)


def fit_study(points: list[RunPoint], bootstrap: int, seed: int) -> dict[str, Any]:
    """Both approaches over the points."""
    n = np.array([p.params for p in points], dtype=np.float64)
    d = np.array([p.tokens for p in points], dtype=np.float64)
    c = np.array([p.flops for p in points])
    loss = np.array([p.loss for p in points])
    return {"approach2": approach2(n, d, c, loss), "approach3": approach3(n, d, loss, bootstrap, seed)}


def prediction_target(preset: Path, tokens: float | None, runs: list[Path]) -> dict[str, Any]:
    """N (and D: `tokens`, else the preset's own max_steps × tokens per step) of the config to predict; it must
    be of the runs' family."""
    cfg: JobConfig = load_job_config(preset)
    check_scalable(cfg.model)
    theirs = family_fields(run_config(runs[0]).get("model", {}))
    ours = family_fields(json.loads(cfg.model.model_dump_json(exclude_none=True)))
    differ = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
    if differ:
        raise UserError(
            f"--predict {preset} is not of the runs' family: model.{', model.'.join(differ)} differ",
            "predict for a preset of the same family (only dim, n_layers, n_heads, n_kv_heads may differ)",
        )
    if tokens is not None and not (math.isfinite(tokens) and tokens >= 1):  # NaN and inf have no whole count
        raise UserError(f"--tokens {tokens:g} must be a positive, finite number of tokens", "e.g. --tokens 2.6e10")
    tokens = int(tokens) if tokens is not None else tokens_per_step(cfg) * cfg.train.max_steps
    params = param_counts(cfg.model)["total"]
    flops = float(training_flops_per_token(cfg.model, cfg.train.seq_len) * tokens)
    return {
        "preset": str(preset),
        "params": params,
        "tokens": tokens,
        "flops": flops,
        "flops_6nd": 6.0 * params * tokens,
    }


def report(points: list[RunPoint], unfinished: list[Unfinished], fits: dict[str, Any]) -> dict[str, Any]:
    """Everything `forge scale fit --json` prints (the prediction is added by the caller)."""
    return {
        "runs": [asdict(p) for p in points],
        "unfinished": [asdict(u) for u in unfinished],
        "approach2": fits["approach2"].as_dict(),
        "approach3": fits["approach3"].as_dict(),
    }
