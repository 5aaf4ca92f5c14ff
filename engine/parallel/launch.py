"""Joining the process group of a multi-process run, whoever started the processes.

torchrun (and `forge train --nproc-per-node`, which runs PyTorch's elastic launcher) sets RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT. `srun` sets only SLURM_* variables: they are translated here, with
the rendezvous on the first node of the allocation (SLURM_LAUNCH_NODE_IPADDR is where srun was called from,
which is that node under `sbatch`) and MASTER_PORT from the environment or a port derived from the job id,
so two jobs sharing a node do not collide.
"""

from __future__ import annotations

import math
import os
import signal
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

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
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:  # a task of `srun`, not the batch script
        return ProcessPlace(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", "0")), int(env["SLURM_NTASKS"]))
    return ProcessPlace(0, 0, 1)


def slurm_rendezvous_env(env: dict[str, str]) -> dict[str, str]:
    """The torchrun-style variables an srun task lacks."""
    place = process_place(env)
    master = env.get("MASTER_ADDR") or env.get("SLURM_LAUNCH_NODE_IPADDR")
    if master is None:
        raise UserError("started by srun, but neither MASTER_ADDR nor SLURM_LAUNCH_NODE_IPADDR is set",
                        "export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1) before srun")
    port = env.get("MASTER_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
    return {"RANK": str(place.rank), "LOCAL_RANK": str(place.local_rank), "WORLD_SIZE": str(place.world_size),
            "MASTER_ADDR": master, "MASTER_PORT": port}


def device_for(place: ProcessPlace) -> torch.device:
    """One GPU per process, chosen by local rank; CPU without GPUs."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if torch.cuda.device_count() == 1 and "SLURM_STEP_ID" in os.environ:  # srun bound one GPU to each task
        return torch.device("cuda", 0)
    if place.local_rank >= torch.cuda.device_count():
        raise UserError(f"local rank {place.local_rank} has no GPU: this node has {torch.cuda.device_count()}",
                        "start at most one process per GPU (--nproc-per-node, or srun --ntasks-per-node)")
    device = torch.device("cuda", place.local_rank)
    torch.cuda.set_device(device)
    return device


def backend_for(spec: str, device: torch.device) -> str:
    """`distributed.backend` for a run on `device`: on GPUs the whole per-device spec (NCCL for CUDA
    tensors, gloo for CPU ones); on CPU only the CPU entry, since a CPU build of torch has no NCCL."""
    if device.type != "cpu":
        return spec
    entries = dict(entry.rpartition(":")[::2] for entry in spec.split(","))
    backend = entries.get("cpu") or entries.get("")
    if backend is None:
        raise UserError(f"distributed.backend = {spec!r} names no backend for CPU tensors, and this run is on CPU",
                        "add one, e.g. 'cpu:gloo,cuda:nccl'")
    return backend


def join_process_group(backend: str, timeout_sec: float, device: torch.device) -> None:
    """Initialise the default process group from the environment (SLURM variables translated first)."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(slurm_rendezvous_env(dict(os.environ)))
    dist.init_process_group(backend=backend_for(backend, device), timeout=timedelta(seconds=timeout_sec),
                            device_id=device if device.type == "cuda" else None)


def leave_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# Signals the launcher passes on to its workers: the elastic launcher's own list plus SIGUSR1, which
# Forge (and SLURM's --signal) uses for preemption.
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def launch_local_workers(nproc: int, module: str, argv: list[str], shutdown_timeout_sec: float, preempted_exit: int,
                         saving_signals: tuple[signal.Signals, ...]) -> int:
    """Run `python -m MODULE ARGV` as `nproc` processes on this node through PyTorch's elastic
    launcher (what `torchrun --standalone` does), and return the exit code the run should end with: 0, the
    first failing rank's own code, `preempted_exit` when one of `saving_signals` stopped the run (the
    workers got it too, saved, and exited with that code, so a requeueing job script sees it either way),
    or 128 + the signal's number for another signal (Ctrl-C). The launcher gives the workers their own
    shutdown deadline (plus a margin) before it kills them."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(["--standalone", f"--nproc-per-node={nproc}", f"--signals-to-handle={FORWARDED_SIGNALS}",
                       f"--shutdown-timeout={math.ceil(shutdown_timeout_sec) + 30}",
                       "--module", module, *argv])
    try:
        run(args)
    except SignalException as stopped:
        return preempted_exit if stopped.sigval in saving_signals else 128 + int(stopped.sigval)
    except ChildFailedError as failed:
        ranks = sorted(failed.failures)
        return next((failed.failures[r].exitcode for r in ranks if failed.failures[r].exitcode > 0), 1)
    return 0
