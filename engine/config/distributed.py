"""`[distributed]`: the parallel layout. The degrees multiply to the world size."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from engine.config.base import Section


class DistributedConfig(Section):
    dp_shard: int = Field(-1, description="FSDP degree; -1 = whatever the other degrees leave")
    dp_replicate: int = Field(1, gt=0, description="replicas of the sharded group (HSDP)")
    tp: int = Field(1, gt=0, description="tensor-parallel degree")
    pp: int = Field(1, gt=0, description="pipeline-parallel degree")
    cp: int = Field(
        1, gt=0, description="context-parallel degree: every sequence is split over cp ranks (long contexts)"
    )
    cp_method: Literal["allgather", "ring", "ulysses"] = Field(
        "allgather",
        description="attention across the cp ranks: allgather (gather K/V), ring (pass K/V blocks around), "
        "ulysses (all-to-all to whole sequences of heads/cp heads; heads divisible by tp × cp)",
    )
    ep: int = Field(1, gt=0, description="expert-parallel degree (MoE): experts sharded over ep of the dp_shard ranks")
    pp_schedule: Literal["1f1b", "gpipe", "interleaved_1f1b"] = Field(
        "1f1b", description="pipeline schedule when pp > 1; interleaved_1f1b runs two stages per rank"
    )
    nccl_timeout_sec: float = Field(
        300.0,
        gt=0,
        description="deadline of every collective (the process group's timeout) and of the health "
        "check (train.nccl_health_check_interval)",
    )
    cpu_offload: bool = Field(
        False,
        description="FSDP2's CPU offload: the weights, gradients and optimizer state live in host memory and the "
        "optimizer steps there; each block's weights are copied to the device for its forward and backward "
        "(FSDP is applied at world size 1 too). Data parallelism only (tp, pp, cp, ep = 1)",
    )
    backend: str = Field(
        "cpu:gloo,cuda:nccl", description="torch.distributed backend per device type; a CPU run uses the cpu entry"
    )

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        parts = [part.strip() for part in value.split(",")]
        for part in parts:
            device, _, name = part.rpartition(":")
            if name not in ("gloo", "nccl", "mpi", "ucc", "xccl") or device not in ("", "cpu", "cuda", "xpu"):
                raise ValueError(f"unknown backend {part!r}; use e.g. 'cpu:gloo,cuda:nccl', 'gloo' or 'nccl'")
        return ",".join(parts)

    def resolved_dp_shard(self, world_size: int) -> int:
        """dp_shard with -1 replaced by what is left of the world size (0 if it does not divide)."""
        rest = self.dp_replicate * self.tp * self.pp * self.cp
        if self.dp_shard != -1:
            return self.dp_shard * self.ep if self.seed_ep_convention(world_size) else self.dp_shard
        return world_size // rest if world_size % rest == 0 else 0

    def seed_ep_convention(self, world_size: int) -> bool:
        """Whether an explicit dp_shard is read as the seed schema writes it, with ep a factor of the world size
        (dp_replicate × dp_shard × tp × pp × cp × ep): Forge's dp_shard then spans dp_shard × ep ranks, the
        same ranks the seed framework shards and splits the experts over. Only where Forge's own reading
        (ep carved out of dp_shard) does not fill the world and the seed's does."""
        rest = self.dp_replicate * self.tp * self.pp * self.cp
        return self.ep > 1 and self.dp_shard > 0 and rest * self.dp_shard * self.ep == world_size
