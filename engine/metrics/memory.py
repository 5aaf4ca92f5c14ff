"""Memory in use, in GiB, under names the dashboard and metrics.jsonl share across devices.

`mem_peak_gib` exists everywhere (GPU: peak allocated by tensors; CPU: the process's peak resident set),
so one column can show memory whatever the device.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

import torch

GIB = 2**30


def memory_stats(device: torch.device) -> dict[str, float]:
    """CUDA: allocated / reserved / peak allocated by the caching allocator. Otherwise: process RSS and peak RSS."""
    if device.type == "cuda":
        return {
            "mem_allocated_gib": torch.cuda.memory_allocated(device) / GIB,
            "mem_reserved_gib": torch.cuda.memory_reserved(device) / GIB,
            "mem_peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
        }
    stats = {"mem_peak_gib": peak_rss_bytes() / GIB}
    rss = current_rss_bytes()
    if rss is not None:
        stats["mem_rss_gib"] = rss / GIB
    return stats


def peak_rss_bytes() -> int:
    """getrusage reports kilobytes on Linux but bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def current_rss_bytes() -> int | None:
    """Resident pages from procfs; None where there is no procfs (macOS), which has no stdlib equivalent."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")
