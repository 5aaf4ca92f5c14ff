"""A CPU's hardware peak FLOP/s, from the CPU's own description (`/proc/cpuinfo`), never from a timing.

peak = cores × FLOP per cycle per core × clock, where FLOP per cycle = 2 (a fused multiply-add is two
FLOPs) × lanes of the FMA datapath × FMA units. Every input is read from the description, so the figure is
the same on every run of the same machine (a timed matmul moved 1.7× between two runs here), and each
input is chosen at its upper bound when the description cannot tell (two FMA units; the highest clock
it states), so MFU against it errs low, never above 100%. docs/metrics.md has the table and the
arithmetic for the debug preset. x86-64 Linux only: elsewhere the peak is unknown and MFU is not reported
(`FORGE_PEAK_FLOPS` sets it by hand).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
MAX_FREQ = Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")  # kHz, boost included
FMA_UNITS = 2  # every x86-64 server core since Haswell / Zen 1 has two FMA pipes (some Xeon Silver: one)
AMX_FLOP_PER_CYCLE = 1024  # Intel AMX (Sapphire Rapids): TDPBF16PS/TDPFP16PS, 512 multiply-adds per cycle per core
HALF_FLAGS = {"bfloat16": ("amx_bf16", "avx512_bf16"), "float16": ("amx_fp16", "avx512_fp16")}
AMD = "AuthenticAMD"
ZEN5_FAMILY = 0x1A  # Zen 5 executes AVX-512 on full 512-bit units; Zen 4 (0x19) splits it into two 256-bit halves


@dataclass(frozen=True)
class CpuDescription:
    """What /proc/cpuinfo says about the first processor, and how many of them this process may use."""

    vendor: str
    family: int
    model_name: str
    flags: frozenset[str]
    clock_hz: float
    clock_source: str
    logical_cpus: int
    threads_per_core: int

    def datapath_bits(self) -> int:
        """Width of one FMA unit: AVX-512 parts are 512 except AMD before Zen 5, whose 512-bit
        instructions run on 256-bit units (so avx512f in the flags does not double the peak there)."""
        if "avx512f" in self.flags:
            return 256 if self.vendor == AMD and self.family < ZEN5_FAMILY else 512
        if "avx2" in self.flags or "avx" in self.flags:
            return 256
        return 128

    def fp32_flop_per_cycle(self) -> int:
        return 2 * (self.datapath_bits() // 32) * FMA_UNITS

    def flop_per_cycle(self, dtype_name: str) -> int:
        """Half-precision matmuls run on AMX tiles where the CPU has them for that type, else at twice the
        fp32 rate where AVX-512 has the type's multiply-add (bf16: VDPBF16PS, two bf16 products per fp32
        lane; fp16: AVX512-FP16, 32 lanes), else converted to fp32 (the fp32 rate)."""
        fp32 = self.fp32_flop_per_cycle()
        if dtype_name in HALF_FLAGS:
            amx, avx512 = HALF_FLAGS[dtype_name]
            if amx in self.flags:
                return AMX_FLOP_PER_CYCLE
            if avx512 in self.flags:
                return 2 * fp32
        return fp32

    def cores(self, threads: int) -> int:
        """Physical cores `threads` compute threads can occupy: SMT siblings share one core's FMA units."""
        physical = max(1, math.ceil(self.logical_cpus / self.threads_per_core))
        return max(1, min(threads, physical))

    def peak(self, dtype_name: str, threads: int) -> float:
        return self.cores(threads) * self.flop_per_cycle(dtype_name) * self.clock_hz


def first_processor(text: str) -> dict[str, str]:
    """The `key : value` lines of /proc/cpuinfo's first processor block."""
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def clock(fields: dict[str, str], max_freq_khz: str | None) -> tuple[float, str] | None:
    """The highest clock the CPU states: cpufreq's maximum (boost) where the kernel exposes it, else the
    nominal clock in the model name ("@ 2.60GHz"), else `cpu MHz` (under a hypervisor, the nominal TSC
    clock)."""
    if max_freq_khz and max_freq_khz.strip().isdigit() and int(max_freq_khz) > 0:
        return int(max_freq_khz) * 1e3, "cpufreq cpuinfo_max_freq"
    named = re.search(r"@\s*([\d.]+)\s*GHz", fields.get("model name", ""))
    if named:
        return float(named.group(1)) * 1e9, "model name"
    try:
        mhz = float(fields.get("cpu MHz", ""))
    except ValueError:
        return None
    return (mhz * 1e6, "cpu MHz") if mhz > 0 else None


def describe(cpuinfo: str, max_freq_khz: str | None, logical_cpus: int) -> CpuDescription | None:
    """Parse a /proc/cpuinfo text; None when it is not an x86-64 description with a clock."""
    fields = first_processor(cpuinfo)
    flags = frozenset(fields.get("flags", "").split())
    found = clock(fields, max_freq_khz)
    if "lm" not in flags or found is None:  # lm: long mode, i.e. x86-64; ARM's cpuinfo has "Features"
        return None
    siblings, cores = int(fields.get("siblings", "1") or 1), int(fields.get("cpu cores", "1") or 1)
    return CpuDescription(
        vendor=fields.get("vendor_id", ""),
        family=int(fields.get("cpu family", "0") or 0),
        model_name=fields.get("model name", ""),
        flags=flags,
        clock_hz=found[0],
        clock_source=found[1],
        logical_cpus=logical_cpus,
        threads_per_core=max(1, siblings // max(1, cores)),
    )


def this_cpu() -> CpuDescription | None:
    """This machine's description, restricted to the CPUs this process may run on."""
    try:
        cpuinfo = CPUINFO.read_text()
    except OSError:
        return None
    try:
        max_freq = MAX_FREQ.read_text()
    except OSError:
        max_freq = None
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return describe(cpuinfo, max_freq, logical)
