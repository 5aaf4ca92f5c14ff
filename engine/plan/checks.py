"""The rules that span a config's sections, in the order they are reported: each room's torch-free `rules.py`
(engine/data/rules.py, engine/model/rules.py, engine/train/rules.py, engine/parallel/rules.py, …) holds the
rules that protect its code, as functions `(cfg: JobConfig, world_size: int) -> list[ConfigIssue]`; this module
lists them and runs them, after the batch and length rules (engine/plan/length_rules.py) whose derived steps and
accumulation the others read. A new rule goes into its room's function for that topic, or a new function
appended at the end of its list (so that what a config reported before keeps its order).
"""

from __future__ import annotations

from collections.abc import Callable

from engine.config.job import JobConfig
from engine.data import rules as data
from engine.errors import ConfigError, ConfigIssue
from engine.eval import rules as evaluation
from engine.metrics import rules as metrics
from engine.model import rules as model
from engine.parallel import rules as parallel
from engine.plan import length_rules
from engine.plan.length import with_derived_length
from engine.train import rules as train

Rule = Callable[[JobConfig, int], list[ConfigIssue]]
"""One room's check of a config for a world size: the problems it finds (errors or warnings), in order."""

ERROR_RULES: tuple[Rule, ...] = (
    model.length_issues,  # train.seq_len within model.max_seq_len
    data.source_issues,  # eval's data source; Hugging Face dataset fields
    train.profiling_issues,
    train.optimization_issues,  # optimizer, scheduler and loss fields, and their combinations
    train.ema_issues,
    model.moe_issues,
    parallel.compile_issues,  # an MoE model compiled in regions
    parallel.layout_issues,  # degrees, tp, pp, ep, cp
    model.lora_issues,
    data.mixture_issues,  # [[data.datasets]] and their phases
    model.family_issues,  # [model] fields the model family has no use for
    evaluation.task_issues,  # eval.tasks: lm-eval installed, a layout that holds the whole model
    train.memory_option_issues,  # 8-bit optimizer state, activation offload: where they work
    model.attention_issues,  # RoPE scaling fields; a sliding window's kernel
    data.source_kind_issues,  # the source kinds path fields name (KIND:LOCATION)
    model.mtp_issues,  # multi-token prediction: its family, layouts and packing
    train.cpu_offload_issues,  # distributed.cpu_offload: data parallelism, fp32 optimizer state
    metrics.sink_issues,  # the fields of a metrics sink that is off
)
"""Every cross-section rule that refuses a config, in the order its errors are listed."""

WARNING_RULES: tuple[Rule, ...] = (train.schedule_warnings, parallel.layout_warnings, model.moe_warnings)
"""Every rule that warns about a config that runs, in the order its warnings are listed."""


def config_issues(cfg: JobConfig, world_size: int, windows: int | None = None) -> list[ConfigIssue]:
    """Every error, all at once: the batch and length rules', or when the lengths derive, every room's on the
    derived config. `windows`: the training data's window count when the caller has it (max_epochs)."""
    return length_rules.issues(cfg, world_size) or [
        issue for rule in ERROR_RULES for issue in rule(with_derived_length(cfg, world_size, windows), world_size)
    ]


def check_config(cfg: JobConfig, world_size: int = 1) -> JobConfig:
    """`cfg`, once the rules that span sections hold for `world_size`; raises ConfigError with every problem."""
    if issues := config_issues(cfg, world_size):
        raise ConfigError(issues)
    return cfg


def config_warnings(cfg: JobConfig, world_size: int = 1) -> list[ConfigIssue]:
    """What a checked config does that the user may not expect, but which is not an error (validate-config and
    `forge train` print them, `--json` lists them): a config that runs elsewhere runs here too."""
    derived = with_derived_length(cfg, world_size)
    return [issue for rule in WARNING_RULES for issue in rule(derived, world_size)] + length_rules.warnings(
        derived, world_size
    )
