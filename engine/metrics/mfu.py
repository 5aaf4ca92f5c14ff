"""Model FLOPs utilisation: achieved training FLOP/s over the device's dense peak FLOP/s.

Peaks are vendor datasheet figures for dense math (never the 2:4-sparsity numbers), per device as torch
sees it. On a CPU the peak is computed from the CPU's own description (engine.metrics.cpu_peak: cores ×
FMA width × FMA units × clock), never timed: a start-up matmul benchmark moves with whatever else the
machine is doing, and MFU must not. `FORGE_PEAK_FLOPS` (FLOP/s, e.g. `989e12`) overrides everything, for
devices missing from the table.
"""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass

import torch

from engine.errors import UserError
from engine.metrics.cpu_peak import CpuDescription, this_cpu

PEAK_ENV = "FORGE_PEAK_FLOPS"
T = 1e12


@dataclass(frozen=True)
class DevicePeak:
    """Dense FLOP/s by matmul precision; None where the hardware has no fast path for it."""

    bf16: float | None
    fp16: float
    tf32: float | None
    fp32: float


# First match wins, so the specific names (NVL, PCIe) come before the family. Patterns are searched in
# torch.cuda.get_device_name(), e.g. "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-16GB".
GPU_PEAKS: tuple[tuple[str, DevicePeak], ...] = (
    (r"\bB200\b", DevicePeak(bf16=2250 * T, fp16=2250 * T, tf32=1125 * T, fp32=75 * T)),
    (r"\bH[12]00 NVL\b", DevicePeak(bf16=835.5 * T, fp16=835.5 * T, tf32=417.5 * T, fp32=60 * T)),
    (r"\bH100 PCIe\b", DevicePeak(bf16=756.5 * T, fp16=756.5 * T, tf32=378 * T, fp32=51 * T)),
    (r"\b(H100|H200|H800|GH200)\b", DevicePeak(bf16=989.5 * T, fp16=989.5 * T, tf32=494.5 * T, fp32=67 * T)),
    (r"\b(A100|A800)\b", DevicePeak(bf16=312 * T, fp16=312 * T, tf32=156 * T, fp32=19.5 * T)),
    (r"\bL40S\b", DevicePeak(bf16=362 * T, fp16=362 * T, tf32=183 * T, fp32=91.6 * T)),
    (r"\bL40\b", DevicePeak(bf16=181 * T, fp16=181 * T, tf32=90.5 * T, fp32=90.5 * T)),
    (r"\bL4\b", DevicePeak(bf16=121 * T, fp16=121 * T, tf32=60 * T, fp32=30.3 * T)),
    (r"\bA10G?\b", DevicePeak(bf16=125 * T, fp16=125 * T, tf32=62.5 * T, fp32=31.2 * T)),
    (r"\bRTX 4090\b", DevicePeak(bf16=165.2 * T, fp16=165.2 * T, tf32=82.6 * T, fp32=82.6 * T)),
    (r"\bRTX 3090\b", DevicePeak(bf16=71 * T, fp16=71 * T, tf32=35.6 * T, fp32=35.6 * T)),
    (r"\bV100S\b", DevicePeak(bf16=None, fp16=130 * T, tf32=None, fp32=16.4 * T)),
    (r"\bV100-PCIE\b", DevicePeak(bf16=None, fp16=112 * T, tf32=None, fp32=14 * T)),
    (r"\bV100\b", DevicePeak(bf16=None, fp16=125 * T, tf32=None, fp32=15.7 * T)),
    (r"\bT4\b", DevicePeak(bf16=None, fp16=65 * T, tf32=None, fp32=8.1 * T)),
    (r"\bMI3(00|25)X\b", DevicePeak(bf16=1307.4 * T, fp16=1307.4 * T, tf32=653.7 * T, fp32=163.4 * T)),
    (r"\bMI250X\b", DevicePeak(bf16=191.5 * T, fp16=191.5 * T, tf32=None, fp32=47.9 * T)),  # one GCD = one torch device
)


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of `device` for matmuls in `dtype`; None when unknown (MFU is then not reported)."""
    override = os.environ.get(PEAK_ENV)
    if override:
        return parse_override(override)
    if device.type == "cuda":
        tf32 = torch.get_float32_matmul_precision() != "highest"
        return table_peak(torch.cuda.get_device_name(device), dtype, tf32)
    if device.type == "cpu":
        return cpu_peak(dtype, torch.get_num_threads())
    return None


def mfu(flops_per_token: float, tokens_per_sec: float, peak: float | None) -> float | None:
    """Fraction of peak used. Pass one device's throughput and peak (or the global ones × world size).

    None without a peak, and None above 1: more than the peak proves the peak wrong (a CPU running above
    every clock it states), and an impossible figure is worse than none."""
    if not peak:
        return None
    value = flops_per_token * tokens_per_sec / peak
    return value if value <= 1.0 else None


def parse_override(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise UserError(
            f"{PEAK_ENV}={text!r} is not a positive number of FLOP/s",
            f"set it to the device's dense peak, e.g. {PEAK_ENV}=989e12, or unset it",
        )
    return value


def table_peak(device_name: str, dtype: torch.dtype, tf32: bool) -> float | None:
    """Look `device_name` up in GPU_PEAKS; fp32 counts at the TF32 rate when torch is allowed to use it."""
    for pattern, peak in GPU_PEAKS:
        if re.search(pattern, device_name, re.IGNORECASE):
            if dtype == torch.bfloat16:
                return peak.bf16
            if dtype == torch.float16:
                return peak.fp16
            if dtype == torch.float32:
                return peak.tf32 if tf32 and peak.tf32 else peak.fp32
            return None
    return None


@functools.cache
def described_cpu() -> CpuDescription | None:
    """Read once per process: the description does not change while it runs."""
    return this_cpu()


def cpu_peak(dtype: torch.dtype, threads: int) -> float | None:
    """This CPU's hardware peak for `threads` compute threads in `dtype`; None where it cannot be described
    (not x86-64 Linux): MFU is then not reported, rather than measured against a guess."""
    cpu = described_cpu()
    return None if cpu is None else cpu.peak(str(dtype).removeprefix("torch."), threads)
