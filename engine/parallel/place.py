"""Which process of a run this is, from the environment alone (no torch: the CLI asks it on every error).

torchrun (and `forge train --nproc-per-node`, which runs PyTorch's elastic launcher) sets RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT. `srun` sets only SLURM_* variables: they are translated here, with
the rendezvous on the first node of the allocation (SLURM_LAUNCH_NODE_IPADDR is where srun was called from,
which is that node under `sbatch`) and MASTER_PORT from the environment or a port derived from the job id,
so two jobs sharing a node do not collide.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine.errors import UserError


@dataclass(frozen=True)
class ProcessPlace:
    rank: int
    local_rank: int
    world_size: int


def process_place(env: dict[str, str] | None = None) -> ProcessPlace:
    """This process's rank, local rank and the world size, from torchrun's or SLURM's variables."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" in env:
        return ProcessPlace(int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0")), int(env["WORLD_SIZE"]))
    if (
        "SLURM_NTASKS" in env and "SLURM_PROCID" in env and "SLURM_STEP_ID" in env
    ):  # a task of `srun`, not the batch script
        return ProcessPlace(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", "0")), int(env["SLURM_NTASKS"]))
    return ProcessPlace(0, 0, 1)


def slurm_rendezvous_env(env: dict[str, str]) -> dict[str, str]:
    """The torchrun-style variables an srun task lacks."""
    place = process_place(env)
    master = env.get("MASTER_ADDR") or env.get("SLURM_LAUNCH_NODE_IPADDR")
    if master is None:
        raise UserError(
            "started by srun, but neither MASTER_ADDR nor SLURM_LAUNCH_NODE_IPADDR is set",
            "export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1) before srun",
        )
    port = env.get("MASTER_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
    return {
        "RANK": str(place.rank),
        "LOCAL_RANK": str(place.local_rank),
        "WORLD_SIZE": str(place.world_size),
        "MASTER_ADDR": master,
        "MASTER_PORT": port,
    }
