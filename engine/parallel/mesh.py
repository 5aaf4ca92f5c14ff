"""The parallel layout as one `DeviceMesh` with named dimensions.

The dimensions, outermost first: `pp` (pipeline stages), `dp_replicate` (HSDP replicas), `dp_shard` (FSDP
shards), `cp` (context parallel), `tp` (tensor parallel). Innermost dimensions hold neighbouring ranks, so
the chattiest one (tp, a collective in every layer) stays inside a node, and the least chatty one (pp, one
send per micro-batch) spans nodes. Only the dimensions of degree > 1 are built; the data-parallel ones are
always built together when either is > 1, so FSDP gets its 2-D HSDP mesh even when one side is 1.

Derived 1-D meshes, flattened from the named ones:
  `dp`  = dp_replicate × dp_shard: ranks that read different data (the batch is split over it);
  `fsdp` is not flattened: HSDP takes the 2-D (dp_replicate, dp_shard) mesh, plain FSDP the `dp_shard` one;
  `dp_shard_cp` = dp_shard × cp: under context parallelism FSDP shards the parameters over the cp ranks too
  (they hold the same parameters and each computes a part of every sequence's gradient, which FSDP's
  reduce-scatter averages, like torchtitan's layout).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from engine.config.distributed import DistributedConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of one run, with dp_shard = -1 already resolved against the world size."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # not a dimension of its own: ep of the dp_shard ranks split the experts among them

    @classmethod
    def from_config(cls, cfg: DistributedConfig, world_size: int) -> ParallelDims:
        dims = cls(
            pp=cfg.pp,
            dp_replicate=cfg.dp_replicate,
            dp_shard=cfg.resolved_dp_shard(world_size),
            cp=cfg.cp,
            tp=cfg.tp,
            ep=cfg.ep,
        )
        assert dims.world_size == world_size, f"{dims} does not fill {world_size} ranks (config validation missed it)"
        return dims

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches one step reads at a time."""
        return self.dp_replicate * self.dp_shard

    def mesh_dims(self) -> list[tuple[str, int]]:
        degrees = {name: getattr(self, name) for name in MESH_DIMS}
        data_parallel = self.dp > 1
        dims = [
            (name, size)
            for name, size in degrees.items()
            if size > 1 or (data_parallel and name in ("dp_replicate", "dp_shard"))
        ]
        if self.ep == 1:
            return dims
        # dp_shard = expert_dp × ep: ep neighbouring ranks hold different experts, expert_dp copies of each.
        at = [name for name, _ in dims].index("dp_shard")
        return [*dims[:at], ("expert_dp", self.dp_shard // self.ep), ("ep", self.ep), *dims[at + 1 :]]


@dataclass
class ParallelMesh:
    """The world's mesh and the sub-meshes the parallelisms apply over (None where the degree is 1)."""

    dims: ParallelDims
    mesh: DeviceMesh

    def __post_init__(self) -> None:
        # Flattening creates a process group (a collective on every rank): once, here, on all ranks alike.
        self.expert_shard: DeviceMesh | None = None  # with ep under HSDP: dp_shard, flattened from expert_dp × ep
        if self.dims.ep > 1 and self.dims.dp_replicate > 1:
            self.expert_shard = self.mesh["expert_dp", "ep"]._flatten("dp_shard")
            self.dp = self.mesh["dp_replicate", "expert_dp", "ep"]._flatten("dp")
        elif self.dims.ep > 1:
            self.dp = self.mesh["expert_dp", "ep"]._flatten("dp")
        else:
            self.dp = self.mesh["dp_replicate", "dp_shard"]._flatten("dp") if self.dims.dp > 1 else None
        self.dp_shard_cp = None
        if self.dims.cp > 1 and self.dims.dp > 1:
            self.dp_shard_cp = self.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")

    def get(self, name: str) -> DeviceMesh | None:
        names = self.mesh.mesh_dim_names or ()
        return self.mesh[name] if name in names else None

    @property
    def fsdp(self) -> DeviceMesh | None:
        """What `fully_shard` shards over: (dp_replicate, dp_shard) for HSDP, dp_shard alone for FSDP; with
        cp > 1, dp_shard × cp in their place (the cp ranks' gradients must be averaged too)."""
        if self.dims.cp > 1:
            if self.dp_shard_cp is None:
                return self.mesh["cp"]
            replicated = self.dims.dp_replicate > 1
            return self.mesh["dp_replicate", "dp_shard_cp"] if replicated else self.mesh["dp_shard_cp"]
        if self.dp is None:
            return None
        if self.expert_shard is not None:  # HSDP with ep: replicated over dp_replicate, sharded over dp_shard
            return self.mesh["dp_replicate", "dp_shard"]
        if self.dims.ep > 1:
            return self.dp
        return self.mesh["dp_replicate", "dp_shard"] if self.dims.dp_replicate > 1 else self.mesh["dp_shard"]

    @property
    def expert_fsdp(self) -> DeviceMesh | None:
        """What `fully_shard` shards the experts over: the ranks holding the same experts, expert_dp, and under
        HSDP (dp_replicate, expert_dp), replicated over dp_replicate like everything else."""
        if self.dims.ep == 1:
            return None
        return self.mesh["dp_replicate", "expert_dp"] if self.dims.dp_replicate > 1 else self.mesh["expert_dp"]

    @property
    def dp_rank(self) -> int:
        return 0 if self.dp is None else self.dp.get_local_rank()


def build_mesh(dims: ParallelDims, device_type: str) -> ParallelMesh | None:
    """The mesh of a multi-process run; None for a single process."""
    if dims.world_size == 1:
        return None
    names, sizes = zip(*dims.mesh_dims())
    return ParallelMesh(dims, init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names)))
