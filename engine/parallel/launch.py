"""Starting the processes of a multi-process run on this node, and joining their process group, whoever
started them (this launcher, torchrun, or srun: `engine.parallel.place` reads which process this is)."""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import os
import signal
import sys
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from engine.errors import UserError
from engine.parallel.place import ProcessPlace, slurm_rendezvous_env
from engine.resilience.collectives import distributed


def device_for(place: ProcessPlace) -> torch.device:
    """One GPU per process, chosen by local rank; CPU without GPUs."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if torch.cuda.device_count() == 1 and "SLURM_STEP_ID" in os.environ:  # srun bound one GPU to each task
        return torch.device("cuda", 0)
    if place.local_rank >= torch.cuda.device_count():
        raise UserError(
            f"local rank {place.local_rank} has no GPU: this node has {torch.cuda.device_count()}",
            "start at most one process per GPU (--nproc-per-node, or srun --ntasks-per-node)",
        )
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
        raise UserError(
            f"distributed.backend = {spec!r} names no backend for CPU tensors, and this run is on CPU",
            "add one, e.g. 'cpu:gloo,cuda:nccl'",
        )
    return backend


_joined = False  # whether this process ever joined a process group (see end_process)


def use_rank_compile_cache(rank: int) -> None:
    """Give this rank a compile cache of its own: TORCHINDUCTOR_CACHE_DIR (the user's, or PyTorch's default)
    plus `rank{rank}`, before anything compiles.

    Why: PyTorch's on-disk AOTAutograd cache (torch 2.13) keys a graph by its dynamo graph and its inputs, and
    a DTensor input by its spec (mesh, placements, global shape), which is the same on every rank; the graph
    it stores is traced on one rank and can bake that rank's mesh coordinate in. Measured: a tensor-parallel
    module's input hook redistributes a sequence-sharded input to Replicate, and its traced backward keeps
    `split(grad, seq/tp, dim=1)[coordinate]`. Both ranks save an entry under the same key, and once warm both
    load the same one, so one rank takes the other rank's slice of the gradient (attention compiled as a region,
    as in MoE blocks, under tp = 2: 76-110 % relative error in a norm's first-step gradient; exact with the
    cache off or per rank). Upstream (pytorch#188390) adds the local tensor's device to the key,
    which does not tell CPU ranks apart. A cache per rank keeps warm starts (each rank reads its own
    entries) at the cost of one copy of the cache per rank."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir(), f"rank{rank}")


def join_process_group(backend: str, timeout_sec: float, device: torch.device) -> None:
    """Initialise the default process group from the environment (SLURM variables translated first), with a
    compile cache for this rank alone (`use_rank_compile_cache`). A process already in a group stays in it
    (one process evaluating, then training, as tests/eval/test_eval.py does)."""
    global _joined  # noqa: PLW0603  (one fact about this process, read by end_process)
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(slurm_rendezvous_env(dict(os.environ)))
    if not _joined:  # once per process: a second join must not nest another rank folder
        use_rank_compile_cache(int(os.environ["RANK"]))
    dist.init_process_group(
        backend=backend_for(backend, device),
        timeout=timedelta(seconds=timeout_sec),
        device_id=device if device.type == "cuda" else None,
    )
    _joined = True


def join_single_process_group(backend: str, timeout_sec: float, device: torch.device) -> None:
    """A process group of this one process (an in-memory store, no rendezvous): FSDP2 needs one, and
    `distributed.cpu_offload` applies it to a single-process run (engine/parallel/apply.py, `fsdp_mesh`)."""
    global _joined  # noqa: PLW0603  (see join_process_group)
    if dist.is_initialized():
        return
    dist.init_process_group(
        backend=backend_for(backend, device),
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=timeout_sec),
        device_id=device if device.type == "cuda" else None,
    )
    _joined = True


def joined_process_group() -> bool:
    return _joined


def leave_process_group() -> None:
    if distributed():
        dist.destroy_process_group()


def end_process(code: int) -> NoReturn:
    """End a process that took part in a process group without the interpreter's teardown.

    `destroy_process_group` does not stop gloo's worker and network threads while anything still holds the
    group, and something always does after training: `torch._dynamo` keeps references to the default group
    from its import-time scan of `torch.distributed`, FSDP and DTensor state keeps its subgroups. Those
    threads then run through the interpreter's finalization and the C++ static destructors, and now and then,
    on a loaded machine, a process aborted there ("terminate called without an active exception": exit 134
    after a run that had finished and saved). Everything worth keeping is closed by then (metric sinks, logs,
    checkpoints), so the process stops its child processes (data-loader workers, which the skipped exit
    handlers would have stopped), flushes what is buffered and leaves at once."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout=10)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing more can be said there
            stream.flush()
    os._exit(code)


# Signals the launcher passes on to its workers: the elastic launcher's own list plus SIGUSR1, which
# Forge (and SLURM's --signal) uses for preemption.
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def launch_local_workers(
    nproc: int,
    module: str,
    argv: list[str],
    shutdown_timeout_sec: float,
    preempted_exit: int,
    saving_signals: tuple[signal.Signals, ...],
) -> int:
    """Run `python -m MODULE ARGV` as `nproc` processes on this node through PyTorch's elastic
    launcher (what `torchrun --standalone` does), and return the exit code the run should end with: 0, the
    first failing rank's own code, `preempted_exit` when one of `saving_signals` stopped the run (the
    workers got it too, saved, and exited with that code, so a requeueing job script sees it either way),
    or 128 + the signal's number for another signal (Ctrl-C). The launcher gives the workers their own
    shutdown deadline (plus a margin) before it kills them."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--signals-to-handle={FORWARDED_SIGNALS}",
            f"--shutdown-timeout={math.ceil(shutdown_timeout_sec) + 30}",
            "--module",
            module,
            *argv,
        ]
    )
    try:
        run(args)
    except SignalException as stopped:
        return preempted_exit if stopped.sigval in saving_signals else 128 + int(stopped.sigval)
    except ChildFailedError as failed:
        ranks = sorted(failed.failures)
        return next((failed.failures[r].exitcode for r in ranks if failed.failures[r].exitcode > 0), 1)
    return 0
