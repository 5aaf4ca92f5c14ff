"""Run a test script under torchrun on CPU (gloo), bounded in time, leaving no processes behind.

Tests call `torchrun(script, nproc)` with a Python file (usually written into tmp_path) that does its own
`torch.distributed.init_process_group("gloo")` and writes what the test checks into files. A script ends the
way `forge` ends its ranks: a barrier, `destroy_process_group()`, then `engine.parallel.launch.end_process(0)`,
so that no rank aborts in interpreter teardown after its work is done.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def descendants(pid: int) -> list[int]:
    """Every process below `pid`. torchrun starts its workers in sessions of their own, so killing its
    process group leaves them running, holding the output pipe open."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def torchrun(
    script: Path, nproc: int = 2, *args: str, timeout: float = 180, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run `script` on `nproc` local processes; kill every process it started if it outlives `timeout`."""
    # --standalone: the rendezvous binds a free port itself, where a port picked here and bound seconds later
    # could be taken in between by the other test worker's process groups.
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            out = "(no output: the pipe stayed open after the kill)"
        raise AssertionError(f"torchrun {script.name} timed out after {timeout}s:\n{out[-4000:]}") from None
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    return subprocess.CompletedProcess(command, proc.returncode, out, "")


def run_bounded(command: list[str], timeout: float, **popen: object) -> subprocess.CompletedProcess:
    """Run `command` (e.g. `forge train --nproc-per-node 2`, which starts workers of its own) to completion,
    killing it and everything it started if it outlives `timeout`."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **popen
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise AssertionError(f"{' '.join(command)} timed out after {timeout}s") from None
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def save_sharded_checkpoint(model, step_dir: Path, step: int) -> None:
    """Inside a torchrun script: write what the trainer's checkpointer writes for a sharded `model` (its DCP
    shards from every rank, an AdamW state, the train state and the completion marker), with the folder made
    by rank 0 alone, as a checkpoint saved under FSDP for tests that load one elsewhere."""
    import json

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from engine.checkpoint.dcp import COMPLETE, TRAIN_STATE

    if dist.get_rank() == 0:
        step_dir.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, torch.optim.AdamW(model.parameters()))
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=step_dir)
    dist.barrier()
    if dist.get_rank() == 0:
        (step_dir / TRAIN_STATE).write_text(json.dumps({"step": step}))
        (step_dir / COMPLETE).write_text("")
    dist.barrier()
