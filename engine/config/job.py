"""`JobConfig`: one TOML file, one sub-model per section; and the order in which the rooms' rules check it.

A rule that spans sections belongs to the room whose code it protects, in that room's torch-free `rules.py`
(engine/data/rules.py, engine/model/rules.py, engine/train/rules.py, engine/parallel/rules.py, …): a function
`(cfg: JobConfig, world_size: int) -> list[ConfigIssue]`, for errors and warnings alike. `error_rules` and
`warning_rules` below list those functions in the order their issues are reported; a new rule goes into its
room's function for that topic, or a new function appended at the end of the list (so that what a config
reported before keeps its order).

The rules modules import engine.config's sections and helpers (`JobConfig` for their types alone, never at
run time), so this module imports them only when it validates: `import engine.config` never pulls in a room.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import Field

from engine.config.base import Section
from engine.config.checkpoint import CheckpointConfig
from engine.config.data import DataConfig
from engine.config.distributed import DistributedConfig
from engine.config.eval import EvalConfig
from engine.config.lora import LoraConfig
from engine.config.metrics import MetricsConfig
from engine.config.model import ModelConfig
from engine.config.optimizer import OptimizerConfig
from engine.config.profiling import ProfilingConfig
from engine.config.registry import METRICS_SINKS, MODELS, OPTIMIZERS, SCHEDULERS, SOURCE_KINDS
from engine.config.scheduler import SchedulerConfig
from engine.config.train import TrainConfig
from engine.errors import ConfigError, ConfigIssue


class JobConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    profiling: ProfilingConfig = Field(default_factory=ProfilingConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)

    def validate(self, world_size: int = 1) -> JobConfig:  # type: ignore[override]
        """Check the rules that span sections once the world size is known; raise every problem at once."""
        from engine.train import length_rules
        from engine.train.length import with_derived_length

        # The batch and length rules come first: every other rule reads the steps and accumulation they derive.
        issues = length_rules.issues(self, world_size) or cross_section_issues(
            with_derived_length(self, world_size), world_size
        )
        if issues:
            raise ConfigError(issues)
        return self

    def warnings(self, world_size: int = 1) -> list[ConfigIssue]:
        """What the run does that the user may not expect, but which is not an error (validate-config and
        `forge train` print them, `--json` lists them): a config that runs elsewhere runs here too."""
        from engine.train import length_rules
        from engine.train.length import with_derived_length

        if length_rules.issues(self, world_size):  # the lengths cannot be derived: validate() says why
            return []
        derived = with_derived_length(self, world_size)
        return config_warnings(derived, world_size) + length_rules.warnings(derived, world_size)

    def tokens_per_step(self, world_size: int = 1) -> int:
        """Tokens one optimizer step trains on, summed over the data-parallel ranks (the full global batch's, after
        any ramp)."""
        from engine.data.batch_plan import global_sequences

        return global_sequences(self, world_size) * self.train.seq_len


for components in (
    MODELS,
    OPTIMIZERS,
    SCHEDULERS,
    SOURCE_KINDS,
    METRICS_SINKS,
):  # a later one (a test's toy) recomposes
    components.rebuild_with(JobConfig)

Rule = Callable[[JobConfig, int], list[ConfigIssue]]
"""One room's check of a config for a world size: the problems it finds (errors or warnings), in order."""


def error_rules() -> tuple[Rule, ...]:
    """Every cross-section rule that refuses a config, in the order its errors are listed."""
    from engine.data import rules as data
    from engine.eval import rules as evaluation
    from engine.metrics import rules as metrics
    from engine.model import rules as model
    from engine.parallel import rules as parallel
    from engine.train import rules as train

    return (
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


def warning_rules() -> tuple[Rule, ...]:
    """Every rule that warns about a config that runs, in the order its warnings are listed."""
    from engine.model import rules as model
    from engine.parallel import rules as parallel
    from engine.train import rules as train

    return (train.schedule_warnings, parallel.layout_warnings, model.moe_warnings)


def cross_section_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """Every error of every room's rules, all at once (`error_rules` gives the order)."""
    return [issue for rule in error_rules() for issue in rule(cfg, world_size)]


def config_warnings(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """Values that run, with a meaning worth saying out loud (`warning_rules` gives the order)."""
    return [issue for rule in warning_rules() for issue in rule(cfg, world_size)]
