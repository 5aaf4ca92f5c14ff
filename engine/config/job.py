"""`JobConfig`: one TOML file, one sub-model per section, composed from every registered component's fields.

It checks each section on its own (pydantic); the rules that span sections, and the run's derived length, are
the planning room's (engine/plan/: `check_config`, `resolve`), so `import engine.config` never pulls in a
room's rules or implementation, only the components' configuration classes that compose the sections.
"""

from __future__ import annotations

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


for components in (
    MODELS,
    OPTIMIZERS,
    SCHEDULERS,
    SOURCE_KINDS,
    METRICS_SINKS,
):  # a later one (a test's toy) recomposes
    components.rebuild_with(JobConfig)
