"""A new preset from a few answers (what `forge init` asks): the config built from a base preset and the
answers, written as TOML whose comments say what each field does and which values were derived.

The CLI asks the questions and renders; this module only turns `InitAnswers` into a validated document.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import tomlkit

from engine.config.job import JobConfig
from engine.config.loader import build_job_config, read_preset
from engine.config.model import ModelFields
from engine.config.registry import MODELS, OPTIMIZERS, SCHEDULERS, SOURCE_KINDS
from engine.data.batch_plan import tokens_per_step
from engine.model.moe_config import MOE_FIELDS
from engine.plan.job import ResolvedJob, resolve

DataKind = str
"""The source kind `forge init` asks for: one of the three it knows the questions of (forgecli/init.py: embedded,
shards and hf, each a kind in engine/config/registry.py: SOURCE_KINDS)."""
MOE_DEFAULTS = {"num_experts": 8, "moe_top_k": 2}
"""What a dense base model gets when MoE is asked for: every feed-forward a mixture of 8 experts, top-2 (the
other MoE fields keep their defaults: softmax router, load-balance loss 0.01)."""
LION_LR_DIVISOR = 3
"""Lion takes 3-10x AdamW's lr and 3-10x its weight decay (docs/training.md): the gentle end of that range."""
COMMENT_WIDTH = 100


@dataclass(frozen=True)
class InitAnswers:
    """The questions `forge init` asks. `base` is the preset the new one starts from (its model size and the
    settings nobody was asked about); None = the built-in defaults."""

    base: Path | None = None
    dims: tuple[int, int, int] | None = None
    """Custom (dim, n_layers, n_heads) instead of the base's model size."""
    moe: bool = False
    data: DataKind = "embedded"
    dataset_path: str | None = None
    hf_dataset_name: str | None = None
    tokenizer_path: str | None = None
    gpus_per_node: int = 1
    nodes: int = 1
    precision: str = "auto"
    optimizer: str = "adamw"
    max_steps: int | None = None
    """Steps to train for; None = the base's (or `tokens`)."""
    tokens: int | None = None
    """A token budget instead of steps: max_steps = ceil(tokens / tokens per step)."""

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass
class WrittenPreset:
    """A preset ready to be written: its text, and the job it resolves to on the world size it was checked for."""

    text: str
    job: ResolvedJob
    derived: dict[str, str] = field(default_factory=dict)

    @property
    def config(self) -> JobConfig:
        """The config as the preset gives it (loaded and checked)."""
        return self.job.given

    @property
    def world_size(self) -> int:
        return self.job.world_size


def find_presets(folders: list[Path]) -> dict[str, Path]:
    """The presets (*.toml) in these folders, by file stem; the first folder wins a name found twice."""
    found: dict[str, Path] = {}
    for folder in folders:
        for path in sorted(folder.glob("*.toml")) if folder.is_dir() else ():
            found.setdefault(path.stem, path)
    return found


DEFAULT_PRESET = "debug"  # the model that trains on one CPU in minutes: what a first preset should start from


def default_preset(presets: dict[str, Path]) -> str | None:
    """The preset whose answers `forge init` offers first: `debug` where it is found, else the first one (the
    scaling presets sort before it and would start a newcomer on a model no laptop trains)."""
    return DEFAULT_PRESET if DEFAULT_PRESET in presets else next(iter(presets), None)


def answers_from(base: Path | None) -> InitAnswers:
    """The answers that reproduce `base` (its model, data, precision, optimizer and steps): what `--from`
    writes, and the defaults the prompts offer."""
    cfg = build_job_config(read_preset(base).raw, str(base)) if base is not None else JobConfig()
    data: DataKind = "hf" if cfg.data.hf_dataset_name else "shards" if cfg.data.dataset_path else "embedded"
    d = cfg.distributed
    per_node = max(d.dp_shard, 1) * d.tp * d.pp * d.cp  # dp_shard = -1 fills what it is given: 1 GPU at least
    return InitAnswers(
        base=base,
        moe=cfg.model.is_moe,
        data=data,
        dataset_path=cfg.data.dataset_path,
        hf_dataset_name=cfg.data.hf_dataset_name,
        tokenizer_path=cfg.data.tokenizer_path,
        gpus_per_node=per_node,
        nodes=d.dp_replicate,
        precision=cfg.train.mixed_precision,
        optimizer=cfg.optimizer.name,
        max_steps=cfg.train.max_steps,
    )


def build_preset(answers: InitAnswers, name: str = "preset") -> WrittenPreset:
    """The commented TOML for `answers`, validated (per field and for its world size) before it is returned:
    raises ConfigError when the answers do not make a valid job."""
    raw = read_preset(answers.base).raw if answers.base is not None else {}
    derived: dict[str, str] = {}
    for step in (apply_model, apply_data, apply_layout, apply_precision, apply_optimizer, apply_budget):
        step(raw, answers, derived)
    text = render(raw, answers, derived, name)
    job = resolve(build_job_config(tomlkit.parse(text).unwrap(), name), answers.world_size)
    return WrittenPreset(text, job, derived)


def section(raw: dict[str, Any], name: str) -> dict[str, Any]:
    return raw.setdefault(name, {})


def apply_model(raw: dict[str, Any], answers: InitAnswers, derived: dict[str, str]) -> None:
    """Custom dimensions replace the base's (and its GQA and FFN width, which were sized for them); MoE
    fields come or go with the dense/MoE answer; fields the base's family does not read are dropped."""
    model = section(raw, "model")
    if answers.dims is not None:
        model["dim"], model["n_layers"], model["n_heads"] = answers.dims
        for key in ("n_kv_heads", "ffn_hidden_dim"):
            model.pop(key, None)
    is_moe = model.get("num_experts", 0) > 0
    if answers.moe and not is_moe:
        model.update(MOE_DEFAULTS)
        derived.update(
            {f"model.{key}": "MoE asked for; the other MoE fields keep their defaults" for key in MOE_DEFAULTS}
        )
    elif not answers.moe and is_moe:
        for key in ("num_experts", *MOE_FIELDS):
            model.pop(key, None)
    for key in MODELS.foreign_fields(model.get("model_type", ModelFields.model_fields["model_type"].default)):
        model.pop(key, None)


def apply_data(raw: dict[str, Any], answers: InitAnswers, derived: dict[str, str]) -> None:
    """One training source; evaluation on the embedded corpus's held-out split, else off until held-out
    data is named."""
    data, evaluation = section(raw, "data"), section(raw, "eval")
    source = {"embedded": (None, None), "shards": (answers.dataset_path, None), "hf": (None, answers.hf_dataset_name)}
    if (data.get("dataset_path"), data.get("hf_dataset_name")) == source[answers.data] and (
        answers.data != "hf" or data.get("tokenizer_path") == answers.tokenizer_path
    ):
        return  # the base's own source, with the rest of its [data] and [eval]
    for key in ("dataset_path", *SOURCE_KINDS.owners(), "tokenizer_path"):  # the base's source and its kind's fields
        data.pop(key, None)
    if answers.data == "shards":
        data["dataset_path"] = answers.dataset_path
    elif answers.data == "hf":
        data["hf_dataset_name"], data["tokenizer_path"] = answers.hf_dataset_name, answers.tokenizer_path
    if (
        answers.data != "embedded"
        and evaluation.get("enabled")
        and not (evaluation.get("dataset_path") or evaluation.get("hf_dataset_name"))
    ):
        evaluation["enabled"] = False
        derived["eval.enabled"] = (
            "no held-out data was named: set eval.dataset_path (or eval.hf_dataset_name) and enabled = true to evaluate"
        )


def apply_layout(raw: dict[str, Any], answers: InitAnswers, derived: dict[str, str]) -> None:
    """One process per GPU. On one node the ranks left by the base's tp × pp × cp shard the model (FSDP); on
    several, each node holds a sharded replica (HSDP), so the parameter all-gathers stay inside a node."""
    distributed = section(raw, "distributed")
    model_parallel = math.prod(distributed.get(key, 1) for key in ("tp", "pp", "cp"))
    for key in ("dp_shard", "dp_replicate"):
        distributed.pop(key, None)
    if answers.nodes > 1:
        distributed["dp_replicate"] = answers.nodes
        distributed["dp_shard"] = answers.gpus_per_node // model_parallel
        derived["distributed.dp_replicate"] = f"{answers.nodes} nodes: one replica of the sharded model per node"
        derived["distributed.dp_shard"] = (
            f"{answers.gpus_per_node} GPUs per node / (tp × pp × cp = {model_parallel}) shard the model"
        )
    elif answers.world_size > model_parallel:
        distributed["dp_shard"] = -1
        derived["distributed.dp_shard"] = f"the {answers.world_size} GPUs left by tp × pp × cp shard the model (FSDP)"


def apply_precision(raw: dict[str, Any], answers: InitAnswers, derived: dict[str, str]) -> None:
    train = section(raw, "train")
    train["mixed_precision"] = answers.precision
    if answers.precision != "fp8":
        train.pop("fp8_recipe", None)


def apply_optimizer(raw: dict[str, Any], answers: InitAnswers, derived: dict[str, str]) -> None:
    """The optimizer, without the fields only another one reads; lion's lr and decay scaled from AdamW's;
    schedule_free_adamw with the constant schedule it needs, its warmup moved inside the optimizer."""
    optimizer, scheduler = section(raw, "optimizer"), section(raw, "scheduler")
    before = optimizer.get("name", "adamw")
    optimizer["name"] = answers.optimizer
    for key in OPTIMIZERS.foreign_fields(answers.optimizer):
        optimizer.pop(key, None)
    if answers.optimizer == "lion" and before != "lion":
        optimizer["lr"] = float(f"{optimizer.get('lr', 3e-4) / LION_LR_DIVISOR:.3g}")
        optimizer["weight_decay"] = float(f"{optimizer.get('weight_decay', 0.1) * LION_LR_DIVISOR:.3g}")
        derived["optimizer.lr"] = f"{before}'s lr / {LION_LR_DIVISOR}: lion's updates are larger"
        derived["optimizer.weight_decay"] = f"{before}'s weight decay × {LION_LR_DIVISOR}, to keep lr × decay"
    if answers.optimizer == "schedule_free_adamw" and before != "schedule_free_adamw":
        warmup = scheduler.pop("warmup_steps", 0)
        scheduler.clear()
        scheduler["name"] = "constant"
        derived["scheduler.name"] = "schedule_free_adamw replaces the schedule"
        if warmup:
            optimizer["schedule_free_warmup_steps"] = warmup
            derived["optimizer.schedule_free_warmup_steps"] = "the base preset's scheduler.warmup_steps"
    for key in SCHEDULERS.foreign_fields(scheduler.get("name", "cosine")):
        scheduler.pop(key, None)


def apply_budget(raw: dict[str, Any], answers: InitAnswers, derived: dict[str, str]) -> None:
    """Steps, or a token budget turned into steps; when that changes the base's length, a warmup longer than
    a tenth of the run is cut to a tenth."""
    train, scheduler, optimizer = section(raw, "train"), section(raw, "scheduler"), section(raw, "optimizer")
    before = train.get("max_steps", JobConfig().train.max_steps)
    if answers.tokens is not None:
        per_step = tokens_per_step(build_job_config(raw), answers.world_size)
        train["max_steps"] = max(1, math.ceil(answers.tokens / per_step))
        derived["train.max_steps"] = f"{answers.tokens:,} tokens / {per_step:,} tokens per step, rounded up"
    elif answers.max_steps is not None:
        train["max_steps"] = answers.max_steps
    steps = train.get("max_steps", before)
    if steps == before:
        return
    for table, name, key in (
        (scheduler, "scheduler", "warmup_steps"),
        (optimizer, "optimizer", "schedule_free_warmup_steps"),
    ):
        warmup = table.get(key, 0)
        if warmup > steps // 10:
            table[key] = steps // 10
            derived[f"{name}.{key}"] = f"the base's {warmup} cut to a tenth of the {steps} steps"


def render(raw: dict[str, Any], answers: InitAnswers, derived: dict[str, str], name: str) -> str:
    """The TOML document: a header on how to run it, then each section in schema order, every field under a
    comment that says what it does, derived values marked as such."""
    doc = tomlkit.document()
    for line in header(answers, name):
        doc.add(tomlkit.comment(line) if line else tomlkit.nl())
    for section_name, info in JobConfig.model_fields.items():
        values = raw.get(section_name) or {}
        if not values:
            continue
        table = tomlkit.table()
        for key, spec in info.annotation.model_fields.items():
            if key not in values or values[key] is None:
                continue
            for line in textwrap.wrap(spec.description or "", COMMENT_WIDTH):
                table.add(tomlkit.comment(line))
            item = tomlkit.item(as_toml(values[key]))
            if f"{section_name}.{key}" in derived:
                item.comment(f"derived: {derived[f'{section_name}.{key}']}")
            table.add(key, item)
        doc.add(section_name, table)
    return tomlkit.dumps(doc)


def as_toml(value: Any) -> Any:
    """Tuples as lists: TOML arrays."""
    return [as_toml(item) for item in value] if isinstance(value, (tuple, list)) else value


def header(answers: InitAnswers, name: str) -> list[str]:
    source = f"from {answers.base}" if answers.base is not None else "from the built-in defaults"
    launch = f"forge train {name}"
    if answers.gpus_per_node > 1:
        launch += f" --nproc-per-node {answers.gpus_per_node}"
    lines = [
        f"Written by forge init {source}. Check it with: forge validate-config {name}"
        + (f" --world-size {answers.world_size}" if answers.world_size > 1 else ""),
        f"Train it with: {launch}",
    ]
    if answers.nodes > 1:
        lines.append(f"(on each of the {answers.nodes} nodes, one process per GPU: torchrun or srun)")
    lines.append("Every field is explained by the comment above it; 'derived:' marks values computed from the answers.")
    return [*lines, ""]


def with_budget(answers: InitAnswers, budget: str) -> InitAnswers:
    """The answers with a training length given as text: a number of steps ("300"), or a token budget with a
    unit ("50M", "2B", "1.5e9 tokens"). Raises ValueError for anything else."""
    text = budget.strip().lower().removesuffix("tokens").strip()
    units = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
    if text and text[-1] in units:
        return replace(answers, tokens=round(float(text[:-1]) * units[text[-1]]), max_steps=None)
    if "tokens" in budget.lower():
        return replace(answers, tokens=round(float(text)), max_steps=None)
    return replace(answers, max_steps=int(text), tokens=None)
