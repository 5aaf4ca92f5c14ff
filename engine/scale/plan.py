"""An isoFLOP plan (Chinchilla's approach 2): for each compute budget C, a few sizes of the preset's family
around the budget's expected optimum, each trained on the tokens the budget leaves it. Torch-free.

For a budget C and a member of FLOPs per token f (Forge's count, attention included: what validate-config
shows), the run trains D = C / f tokens, i.e. max_steps = round(D / tokens per step). The expected optimum is
the size at which D / N = tokens_per_param (by default Chinchilla's ~20 tokens per parameter); the K sizes are spread
evenly in log N from optimum / span to optimum × span, each snapped to the nearest member of the family.
Every point is a whole resolved config that `forge train` takes, with evaluation on at its last step.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.config.job import JobConfig
from engine.config.loader import dump_toml
from engine.durable import write_durably
from engine.errors import ConfigError, UserError
from engine.plan import check_config, resolve
from engine.safe_paths import file_in, plain_name, resolves_inside
from engine.scale.family import Member, members

PLAN_FILE = "plan.json"
CONFIGS = "configs"
RUNS = "runs"
TOKENS_PER_PARAM = 20.0
MIN_STEPS = 10  # fewer and the step rounding alone moves a run's compute by more than 5%
MIN_BUDGET_RATIO = 1.5  # budgets closer than this cannot be told apart by their runs' FLOPs (fit.group_budgets)
# Step-counted fields of [scheduler] that scale with each point's max_steps, keeping the preset's proportions.
SCHEDULE_STEPS = ("warmup_steps", "decay_steps", "stable_steps", "rewarmup_steps")


@dataclass(frozen=True)
class PlanPoint:
    name: str
    budget: float  # the budget asked for (FLOPs)
    params: int  # N
    flops_per_token: int  # Forge's count
    tokens: int  # D = max_steps × tokens per step
    max_steps: int
    flops: float  # Forge's count: flops_per_token × tokens
    flops_6nd: float  # 6·N·D
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    config: str  # relative to the plan folder
    run_dir: str  # relative to the plan folder


@dataclass
class Plan:
    preset: str
    world_size: int
    tokens_per_step: int
    sizes_per_budget: int
    span: float
    tokens_per_param: float
    budgets: list[float]
    points: list[PlanPoint] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def parse_budgets(text: str) -> list[float]:
    """`1e17,3e17,1e18` → floats, ascending; each positive and the set without near-duplicates."""
    try:
        budgets = sorted(float(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise UserError(f"--budgets {text!r} is not a list of numbers", "e.g. --budgets 1e17,3e17,1e18") from None
    if not budgets or any(not math.isfinite(b) or b <= 0 for b in budgets):
        raise UserError(f"--budgets {text!r}: give positive FLOP counts", "e.g. --budgets 1e17,3e17,1e18")
    for low, high in itertools.pairwise(budgets):
        if high < MIN_BUDGET_RATIO * low:
            raise UserError(
                f"budgets {low:g} and {high:g} are less than {MIN_BUDGET_RATIO}× apart: their runs' FLOPs "
                "could not be told apart when the plan is fitted",
                f"space the budgets at least {MIN_BUDGET_RATIO}× apart (e.g. ×3 per budget)",
            )
    return budgets


def make_plan(
    cfg: JobConfig,
    preset: str,
    budgets: list[float],
    sizes: int,
    span: float,
    world_size: int = 1,
    tokens_per_param: float = TOKENS_PER_PARAM,
) -> tuple[Plan, dict[str, JobConfig]]:
    """The plan and each point's config (validated for `world_size`); nothing is written. Raises a
    `UserError` naming the budget whose sizes or step counts cannot be trained sensibly."""
    check_base(cfg)
    if sizes < 3:
        raise UserError(f"--sizes-per-budget {sizes}: a parabola needs 3 sizes per budget", "pass 3 or more")
    if span <= 1:
        raise UserError(f"--span {span:g} must be > 1 (the factor from the optimum to the end sizes)", "e.g. 3")
    if tokens_per_param <= 0:
        raise UserError(f"--tokens-per-param {tokens_per_param:g} must be positive", "e.g. 20 (Chinchilla)")
    base = resolve(cfg, world_size)
    cfg, tokens_per_step = base.given, base.tokens_per_step
    plan = Plan(preset, world_size, tokens_per_step, sizes, span, tokens_per_param, budgets)
    configs: dict[str, JobConfig] = {}
    for budget in budgets:
        for m in budget_members(cfg, budget, sizes, span, tokens_per_param):
            steps = round(budget / m.flops_per_token / tokens_per_step)
            if steps < MIN_STEPS:
                raise UserError(
                    f"budget {budget:g} gives {m.shape} ({human(m.params)} parameters) only {steps} steps of "
                    f"{tokens_per_step} tokens; at least {MIN_STEPS} are needed",
                    "raise the budget, or lower train.batch_size / train.seq_len in the preset",
                )
            name = f"C{short(budget)}_N{human(m.params)}"
            if name in configs:  # two sizes that round to the same three figures
                name += f"_d{m.model.dim}"
            point_cfg = point_config(cfg, m, steps, world_size, name)
            tokens = steps * tokens_per_step
            plan.points.append(
                PlanPoint(
                    name,
                    budget,
                    m.params,
                    m.flops_per_token,
                    tokens,
                    steps,
                    float(m.flops_per_token * tokens),
                    6.0 * m.params * tokens,
                    m.model.dim,
                    m.model.n_layers,
                    m.model.n_heads,
                    m.model.kv_heads,
                    f"{CONFIGS}/{name}.toml",
                    f"{RUNS}/{name}",
                )
            )
            configs[name] = point_cfg
    return plan, configs


def check_base(cfg: JobConfig) -> None:
    """What a plan cannot carry from its preset: anything tied to one run's steps or files."""
    refusals = {
        "checkpoint.load_path": cfg.checkpoint.load_path is not None,
        "lora.enabled": cfg.lora.enabled,
        "data.phases": bool(cfg.data.phases),
        "data.anneal_start_step": cfg.data.anneal_start_step is not None,
        "scheduler.cycles": cfg.scheduler.cycles is not None,
        "checkpoint.dir (absolute)": Path(cfg.checkpoint.dir).is_absolute(),
    }
    for name, refused in refusals.items():
        if refused:
            raise UserError(
                f"{name} is set in the preset: every point of a scaling plan trains from scratch for its own "
                "number of steps into its own run directory",
                f"remove {name.split(' ')[0]} from the preset for the study",
            )


def budget_members(cfg: JobConfig, budget: float, sizes: int, span: float, tokens_per_param: float) -> list[Member]:
    """K distinct members spread evenly in log N over [optimum / span, optimum × span], the optimum being the
    size that trains on `tokens_per_param` tokens per parameter."""
    found: list[Member] = []
    for m in members(cfg.model, cfg.train.seq_len):
        found.append(m)
        if len(found) > 1 and budget / m.flops_per_token / m.params < tokens_per_param / (2 * span**2):
            break  # well past the largest size this budget asks for
    else:
        raise UserError(f"budget {budget:g} asks for models beyond the family's largest size", "lower the budget")
    log_n = [math.log(m.params) for m in found]
    ratio = [math.log(budget / m.flops_per_token / m.params) for m in found]  # falls as N grows
    optimum = interpolate(math.log(tokens_per_param), ratio[::-1], log_n[::-1])
    targets = [optimum + math.log(span) * (2 * k / (sizes - 1) - 1) for k in range(sizes)]
    smallest = found[0]
    if len(found) > 1 and targets[0] < log_n[0] - (log_n[1] - log_n[0]) / 2:
        raise UserError(
            f"budget {budget:g}: its smallest size would be ~{human(math.exp(targets[0]))} parameters, below the "
            f"family's smallest sensible model ({smallest.shape}, {human(smallest.params)})",
            "raise the budget, or lower --span",
        )
    chosen = [min(found, key=lambda m, t=t: abs(math.log(m.params) - t)) for t in targets]
    if len({m.params for m in chosen}) < sizes:
        raise UserError(
            f"budget {budget:g}: the family has fewer than {sizes} distinct sizes between "
            f"{human(math.exp(targets[0]))} and {human(math.exp(targets[-1]))} parameters",
            "raise --span or the budget, or lower --sizes-per-budget",
        )
    return chosen


def interpolate(x: float, xs: list[float], ys: list[float]) -> float:
    """Linear interpolation of ys over increasing xs, extended linearly beyond the ends."""
    if len(xs) == 1:
        return ys[0]
    i = next((i for i in range(1, len(xs) - 1) if xs[i] >= x), len(xs) - 1)
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])


def point_config(cfg: JobConfig, m: Member, steps: int, world_size: int, name: str) -> JobConfig:
    """The preset with the member's [model], `steps` steps (schedule lengths scaled in proportion) and an
    evaluation at the last step only (`eval.interval = max_steps`; the loop always evaluates the last step)."""
    data: dict[str, Any] = cfg.model_dump()
    data["model"] = m.model.model_dump()
    scale = steps / cfg.train.max_steps
    for key in SCHEDULE_STEPS:
        if data["scheduler"].get(key):
            data["scheduler"][key] = max(1, round(data["scheduler"][key] * scale))
    data["train"]["max_steps"] = steps
    data["eval"].update(enabled=True, interval=steps)
    try:
        return check_config(JobConfig.model_validate(data), world_size)
    except ConfigError as err:
        raise ConfigError(err.issues, f"scaling point {name}") from None


def write_plan(out: Path, plan: Plan, configs: dict[str, JobConfig]) -> None:
    """The configs, then the plan file last (a plan folder without plan.json is an interrupted write)."""
    if (out / PLAN_FILE).exists():
        raise UserError(f"{out} already holds a plan ({out / PLAN_FILE})", "pass another --out, or delete it first")
    (out / CONFIGS).mkdir(parents=True, exist_ok=True)
    for name, point_cfg in configs.items():
        write_durably(out / CONFIGS / f"{name}.toml", dump_toml(point_cfg).encode())
    write_durably(out / PLAN_FILE, plan.to_json().encode())


def read_plan(folder: Path) -> Plan:
    path = folder / PLAN_FILE
    if not path.is_file():
        raise UserError(f"{folder} holds no scaling plan ({path} is missing)", "write one with `forge scale plan`")
    fix = "write the plan again with `forge scale plan`"
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not a JSON plan: {e}", fix) from None
    check_shape(path, "", raw, Plan)
    for i, point in enumerate(raw["points"]):
        check_shape(path, f"points[{i}].", point, PlanPoint)
    if not raw["points"]:
        raise UserError(f"{path} has no points: there are no runs to train or fit", fix)
    for i, point in enumerate(raw["points"]):
        check_point_paths(folder, path, i, point)
    return Plan(**{**raw, "points": [PlanPoint(**p) for p in raw["points"]]})


def check_point_paths(folder: Path, path: Path, i: int, point: dict[str, Any]) -> None:
    """A point's config and run folder are where `write_plan` puts them, `configs/NAME.toml` and `runs/NAME`
    inside the plan folder: `forge scale run` trains into the run folder and `forge scale fit` reads it, so a
    plan.json edited to name `/elsewhere` or `../other-run` is refused before anything is read or written."""
    fix = "write the plan again with `forge scale plan`"
    for key, parent, suffix in (("config", CONFIGS, ".toml"), ("run_dir", RUNS, "")):
        value = point[key]
        head, _, name = value.partition("/")
        if head != parent or not name.endswith(suffix):
            raise UserError(
                f"{path}: points[{i}].{key} = {json.dumps(value)[:60]} is not {parent}/NAME{suffix} inside the plan",
                fix,
            )
        plain_name(name, f"{path} (points[{i}].{key})")
        if not resolves_inside(folder / parent, folder):
            raise UserError(f"{folder / parent} leads out of the plan folder {folder} (a symbolic link)", fix)
    file_in(folder / CONFIGS, point["config"].partition("/")[2], path)


# What a plan.json field of each annotated type must hold (JSON has no int/float distinction for 2.0 → 2).
JSON_TYPES = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v),
    "list[float]": lambda v: isinstance(v, list) and all(JSON_TYPES["float"](x) for x in v),
    "list[PlanPoint]": lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v),
}


def check_shape(path: Path, prefix: str, raw: Any, kind: type) -> None:
    """`raw` holds exactly `kind`'s fields, each of its type: a plan.json edited by hand or cut short is named
    with its first wrong field, rather than failing as a TypeError or KeyError where the plan is used."""
    fix = "write the plan again with `forge scale plan`"
    if not isinstance(raw, dict):
        raise UserError(f"{path}: {prefix.rstrip('.') or 'the plan'} is not a JSON object", fix)
    expected = {f.name: f.type for f in fields(kind)}
    unknown = sorted(raw.keys() - expected.keys())
    if unknown:
        raise UserError(f"{path}: {prefix}{unknown[0]} is not a field of a plan", fix)
    for name, annotation in expected.items():
        if name not in raw:
            raise UserError(f"{path}: {prefix}{name} is missing", fix)
        if not JSON_TYPES[annotation](raw[name]):
            raise UserError(f"{path}: {prefix}{name} = {json.dumps(raw[name])[:60]} is not of type {annotation}", fix)


def short(x: float) -> str:
    """1e18 → '1e18', 3.5e17 → '3.5e17'."""
    mantissa, exponent = f"{x:.3g}".split("e") if "e" in f"{x:.3g}" else (f"{x:.3g}", "0")
    return f"{mantissa}e{int(exponent)}"


def human(n: float) -> str:
    """A parameter count in three significant figures: 3.1M, 125M, 1.3B."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"
