"""`ResolvedJob`: what a validated config will do on a world size, computed once per command (`resolve`) and
read by `forge validate-config`, `forge train`, `forge scale plan`, `forge slurm submit` and `forge init`: the
config as given and with its derived lengths, the batch plan (ramp included), the layout's data-parallel size,
parameter counts, FLOPs per token and per step, the warnings, and (on first use) the memory per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from engine.config.job import JobConfig
from engine.data.batch_plan import BatchPlan, batch_plan, data_parallel
from engine.errors import ConfigIssue
from engine.model.estimate import param_counts, training_flops_per_token
from engine.plan.checks import check_config, config_warnings
from engine.plan.length import with_derived_length

if TYPE_CHECKING:
    from engine.parallel.memory import StageMemory


@dataclass(frozen=True, eq=False)
class ResolvedJob:
    given: JobConfig  # checked, as the user gave it (what the run directory records)
    config: JobConfig  # with train.grad_accum_steps and train.max_steps derived (what runs)
    world_size: int
    data_parallel: int  # ranks that read different data (dp_replicate × dp_shard)
    batches: BatchPlan  # each step's sequences and micro-batches, under a ramp too
    parameters: dict[str, int]  # engine.model.estimate.param_counts
    flops_per_token: int  # forward + backward, active parameters and attention
    warnings: tuple[ConfigIssue, ...]

    @property
    def tokens_per_step(self) -> int:
        """Tokens of the full global batch (after any ramp), summed over the data-parallel ranks."""
        return self.batches.full * self.config.train.seq_len

    @property
    def flops_per_step(self) -> int:
        return self.flops_per_token * self.tokens_per_step

    @property
    def total_tokens(self) -> int:
        """The run's tokens, a ramp's smaller steps counted as they are."""
        return self.batches.tokens_before(self.config.train.max_steps)

    @cached_property
    def memory(self) -> list[StageMemory]:
        """Estimated memory per rank of each pipeline stage (engine/parallel/memory.py), computed when read."""
        from engine.parallel.memory import estimate_memory

        return estimate_memory(self.config, self.world_size)


def resolve(cfg: JobConfig, world_size: int = 1) -> ResolvedJob:
    """Check `cfg` for `world_size` processes (ConfigError with every problem) and plan it."""
    given = check_config(cfg, world_size)
    derived = with_derived_length(given, world_size)
    return ResolvedJob(
        given=given,
        config=derived,
        world_size=world_size,
        data_parallel=data_parallel(derived, world_size),
        batches=batch_plan(derived, world_size),
        parameters=param_counts(derived.model),
        flops_per_token=training_flops_per_token(derived.model, derived.train.seq_len),
        warnings=tuple(config_warnings(given, world_size)),
    )
