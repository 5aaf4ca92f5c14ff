"""Environment preflight for `forge doctor`: each check returns data (status, detail, fix); the CLI renders it.

A failed *required* check means training cannot work here (wrong Python, no usable torch, nowhere to write
checkpoints, no local process group); everything else is a warning or plain information. torch is imported
inside the checks so that importing this module stays cheap and a broken torch install becomes a failed
check rather than a crash.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal, NamedTuple

Status = Literal["ok", "warn", "fail", "info"]

MIN_PYTHON = (3, 11)
MIN_TORCH = (2, 13)  # kept in step with pyproject.toml's `torch>=2.13`
MIN_TORCH_TEXT = ".".join(map(str, MIN_TORCH))
GIB = 2**30
DISK_FAIL_GIB = 1.0
DISK_WARN_GIB = 10.0
GLOO_TIMEOUT = timedelta(seconds=30)

# Optional packages: what each one enables and how to get it.
EXTRAS: dict[str, tuple[str, str]] = {
    "wandb": ("Weights & Biases logging (metrics.enable_wandb)", "pip install 'forge-lm[tracking]'"),
    "tensorboard": ("TensorBoard logging (metrics.enable_tensorboard)", "pip install 'forge-lm[tracking]'"),
    "torchao": (
        'FP8 training (train.mixed_precision = "fp8") and QLoRA\'s 4-bit NF4 base (lora.quantize_base)',
        "pip install 'torchao>=0.18'",
    ),
    "transformers": ("the test suite's parity checks against Hugging Face models", "pip install -e '.[dev]'"),
    "scipy": ("scaling-law fits (forge scale fit)", "pip install 'forge-lm[scale]'"),
}


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string like '2.13.0+cpu', compared as numbers ('2.9' < '2.13')."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


@dataclass(frozen=True)
class CheckResult:
    """One line of the checklist; `fix` is empty unless there is something to do."""

    name: str
    status: Status
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


class Outcome(NamedTuple):
    status: Status
    detail: str
    fix: str = ""


def run_checks(directory: Path) -> Iterator[CheckResult]:
    """Run every check in order, yielding each result as soon as it is known (some take a second or two).

    `directory` is where checkpoints and run directories will go: its free space and write permission are
    checked. A check that crashes is reported as failed (or as a warning when optional) instead of hiding
    the checks after it.
    """
    checks: list[tuple[str, bool, Callable[[], Outcome | None]]] = [
        ("python", True, check_python),
        ("torch", True, check_torch),
        ("gpu", False, check_gpus),
        ("nccl", False, check_nccl),
        ("disk space", True, partial(check_disk, directory)),
        ("write permission", True, partial(check_writable, directory)),
        ("gloo process group", True, check_gloo),
        *((f"extra: {pkg}", False, partial(check_extra, pkg)) for pkg in EXTRAS),
        ("slurm", False, check_slurm),
    ]
    for name, required, check in checks:
        try:
            outcome = check()
        except Exception as e:  # a doctor must report a broken environment, not die of it
            outcome = Outcome(
                "fail" if required else "warn",
                f"check crashed: {type(e).__name__}: {e}",
                "a broken install or a bug in the check: share the output of `forge doctor --json`",
            )
        if outcome is not None:
            yield CheckResult(name, *outcome)


def any_failed(results: list[CheckResult]) -> bool:
    return any(r.status == "fail" for r in results)


def check_python() -> Outcome:
    version = ".".join(map(str, sys.version_info[:3]))
    where = f"{version} ({sys.executable})"
    if sys.version_info < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        return Outcome("fail", where, f"use Python >= {need} (e.g. `python{need} -m venv .venv`)")
    return Outcome("ok", where)


def check_torch() -> Outcome:
    try:
        import torch
    except ImportError as e:
        return Outcome(
            "fail", f"cannot import torch: {e}", f"pip install 'torch>={MIN_TORCH_TEXT}' (see README: Installing torch)"
        )
    build = torch_build(torch)
    if release(torch.__version__) < MIN_TORCH:
        return Outcome(
            "fail",
            f"{torch.__version__} ({build}) is older than {MIN_TORCH_TEXT}",
            f"pip install --upgrade 'torch>={MIN_TORCH_TEXT}'",
        )
    return Outcome("ok", f"{torch.__version__} ({build})")


def torch_build(torch: Any) -> str:
    if torch.version.hip:
        return f"ROCm {torch.version.hip} build"
    if torch.version.cuda:
        cudnn = torch.backends.cudnn.version()
        return f"CUDA {torch.version.cuda} build" + (f", cuDNN {cudnn}" if cudnn else "")
    return "CPU build"


def check_gpus() -> Outcome:
    """GPUs are optional (Forge trains on CPU), but a GPU build that sees no GPU is probably a setup mistake."""
    import torch

    gpu_build = bool(torch.version.cuda or torch.version.hip)
    if not torch.cuda.is_available():
        if gpu_build:
            return Outcome(
                "warn",
                "torch has GPU support but sees no GPU",
                "check `nvidia-smi`, the driver, and CUDA_VISIBLE_DEVICES",
            )
        return Outcome("info", "CPU only (this torch build has no GPU support)")
    return Outcome("ok", "; ".join(describe_gpu(torch, i) for i in range(torch.cuda.device_count())))


def describe_gpu(torch: Any, index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    return f"{index}: {props.name} (sm_{props.major}{props.minor}, {total / GIB:.1f} GiB, {free / GIB:.1f} GiB free)"


def check_nccl() -> Outcome | None:
    """Only meaningful with GPUs; returns None (no line) on a CPU machine."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return None
    if not dist.is_nccl_available():
        return Outcome(
            "warn",
            "this torch build has no NCCL: multi-GPU training will not work",
            "install a CUDA build of torch from pytorch.org",
        )
    version = ".".join(map(str, torch.cuda.nccl.version()))
    return Outcome("ok", version)


def check_disk(directory: Path) -> Outcome:
    usage = shutil.disk_usage(directory)
    free, total = usage.free / GIB, usage.total / GIB
    detail = f"{free:.1f} GiB free of {total:.1f} GiB in {directory}"
    fix = "free space or point checkpoints elsewhere (`forge doctor --dir PATH`, then checkpoint.dir = PATH)"
    if free < DISK_FAIL_GIB:
        return Outcome("fail", detail, fix)
    if free < DISK_WARN_GIB:
        return Outcome("warn", f"{detail} (large models' checkpoints need far more than {DISK_WARN_GIB:.0f} GiB)", fix)
    return Outcome("ok", detail)


def check_writable(directory: Path) -> Outcome:
    """Create and delete a real file: permission bits alone miss read-only mounts and quotas."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".forge-doctor-") as f:
            f.write(b"ok")
            f.flush()
    except OSError as e:
        return Outcome(
            "fail",
            f"cannot write in {directory}: {e.strerror or e}",
            "run from a directory you can write to, or fix its permissions",
        )
    return Outcome("ok", f"can create and delete files in {directory}")


def check_gloo() -> Outcome:
    """Start a one-process gloo group on a free local port and all-reduce one tensor, as training would."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return Outcome(
            "fail", "this torch build has no gloo backend", "install an official torch build from pytorch.org"
        )
    if dist.is_initialized():
        return Outcome("info", "skipped: a process group is already running in this process")
    port = free_port()
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=GLOO_TIMEOUT
        )
        value = torch.ones(4)
        dist.all_reduce(value)
        assert value.tolist() == [1.0] * 4, "all_reduce over one process must be the identity"
    except (RuntimeError, ValueError, OSError) as e:
        return Outcome(
            "fail",
            f"{type(e).__name__}: {e}".splitlines()[0],
            "set GLOO_SOCKET_IFNAME to a working interface (e.g. lo) and make sure `hostname` resolves",
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return Outcome("ok", f"1-process group on 127.0.0.1:{port}, all_reduce ok")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_extra(package: str) -> Outcome:
    """Import for real (not just find it): a broken install or version clash shows up only on import.

    Library log noise during the import is silenced.
    """
    purpose, install = EXTRAS[package]
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module(package)
    except ModuleNotFoundError as e:
        if e.name != package:
            return Outcome("warn", f"installed but broken: {e}; needed for {purpose}", install)
        return Outcome("warn", f"not installed; needed for {purpose}", install)
    except Exception as e:  # any import-time failure means the extra is unusable
        return Outcome("warn", f"installed but broken: {type(e).__name__}: {e}".splitlines()[0], install)
    finally:
        logging.disable(logging.NOTSET)
    return Outcome("ok", f"{importlib.metadata.version(package)}, for {purpose}")


def check_slurm() -> Outcome:
    """SLURM's client tools, their version, and whether a controller answers (`scontrol ping`): what
    `forge slurm` needs. Only information where there are no tools: most machines train without SLURM."""
    tools = {tool: shutil.which(tool) for tool in ("sbatch", "srun", "scontrol")}
    job = os.environ.get("SLURM_JOB_ID")
    inside = f"; inside SLURM job {job}" if job else ""
    found = [f"{tool} ({path})" for tool, path in tools.items() if path]
    if not tools["sbatch"] or not tools["scontrol"]:
        return Outcome(
            "info",
            (", ".join(found) or "sbatch/srun/scontrol not on PATH") + " (needed only for `forge slurm`)" + inside,
        )
    try:
        version = subprocess.run([tools["sbatch"], "--version"], capture_output=True, text=True, timeout=10)
        ping = subprocess.run([tools["scontrol"], "ping"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        return Outcome("warn", f"{', '.join(found)}: {err}", "check the SLURM client installation")
    if version.returncode != 0:  # the tools read slurm.conf before anything else, --version included
        said = (version.stderr.strip() or version.stdout.strip()).splitlines()
        return Outcome(
            "warn",
            f"{', '.join(found)}, but no SLURM configuration: {said[-1] if said else 'no output'}{inside}",
            "set SLURM_CONF to the cluster's slurm.conf, or run on a login node",
        )
    version, answer = version.stdout.strip(), " ".join((ping.stdout.strip() or ping.stderr.strip()).split())
    if ping.returncode != 0 or " is UP" not in answer:
        return Outcome(
            "warn",
            f"{version}; no controller answers: {answer}{inside}",
            "check that slurmctld runs and SLURM_CONF names the cluster's slurm.conf",
        )
    return Outcome("ok", f"{version}; controller {answer}; {', '.join(found)}{inside}")
