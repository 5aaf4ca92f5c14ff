"""`[distributed]`: the parallel layout. The degrees multiply to the world size."""

from __future__ import annotations

from pydantic import Field

from engine.config.base import Section


class DistributedConfig(Section):
    dp_shard: int = Field(-1, description="FSDP degree; -1 = whatever the other degrees leave")
    dp_replicate: int = Field(1, gt=0, description="replicas of the sharded group (HSDP)")
    tp: int = Field(1, gt=0, description="tensor-parallel degree")
    pp: int = Field(1, gt=0, description="pipeline-parallel degree")
    cp: int = Field(1, gt=0, description="context-parallel degree")
    nccl_timeout_sec: float = Field(300.0, gt=0, description="deadline for the collective health check (train.nccl_health_check_interval)")

    def resolved_dp_shard(self, world_size: int) -> int:
        """dp_shard with -1 replaced by what is left of the world size (0 if it does not divide)."""
        if self.dp_shard != -1:
            return self.dp_shard
        rest = self.dp_replicate * self.tp * self.pp * self.cp
        return world_size // rest if world_size % rest == 0 else 0
