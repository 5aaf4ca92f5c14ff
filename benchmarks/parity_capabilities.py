"""Run the parity tests (`pytest -m parity`) under each ATEN_CPU_CAPABILITY this CPU has and record, for
each test, the largest deviation it saw against its tolerance.

ATEN_CPU_CAPABILITY picks PyTorch's CPU kernels (default = no vector extensions, avx2, avx512): they sum in
other orders, so a tolerance tuned to one of them would show here. Every test process (and the torchrun
workers the tests start, which inherit the environment) uses the capability; FORGE_PARITY_LOG collects the
deviations (tests/helpers/parity.py).

    python benchmarks/parity_capabilities.py            # writes benchmarks/results/parity_cpu_capabilities.md
    python benchmarks/parity_capabilities.py --workers 2 --capabilities default avx2
    python benchmarks/parity_capabilities.py --workers 0 --concurrent   # the capabilities side by side

One thread per process (OMP_NUM_THREADS=1), as `make test`; `--workers` xdist workers per capability (0 =
none); `--concurrent` runs the capabilities at the same time instead of one after the other (each then gets a
share of the cores: the wall times are not comparable with a run alone).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_tile")


def cpu_info() -> tuple[str, list[str]]:
    """The CPU's model name and which of FLAGS it has (Linux /proc/cpuinfo)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return model or platform.processor(), [f for f in FLAGS if f in flags]


def capabilities(flags: list[str]) -> list[str]:
    """default always; avx2 and avx512 where the CPU has them."""
    return ["default"] + [c for c, flag in (("avx2", "avx2"), ("avx512", "avx512f")) if flag in flags]


def used_capability(env: dict[str, str]) -> str:
    """What torch reports under `env` (it falls back silently where the CPU lacks the one asked for)."""
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip()


def run(capability: str, workers: int, scratch: Path, select: list[str]) -> dict:
    """pytest -m parity under one capability → counts, wall time and the deviation records."""
    log, junit = scratch / f"{capability}.jsonl", scratch / f"{capability}.xml"
    # A compile cache of its own: inductor builds its kernels for the capability, and a kernel or precompiled
    # header built under another one (a concurrent run's, an earlier run's) must not be reused.
    env = {
        **os.environ,
        "ATEN_CPU_CAPABILITY": capability,
        "OMP_NUM_THREADS": "1",
        "FORGE_PARITY_LOG": str(log),
        "TORCHINDUCTOR_CACHE_DIR": str(scratch / f"inductor-{capability}"),
    }
    xdist = ["-n", str(workers), "--dist", "loadfile"] if workers else ["-p", "no:xdist"]
    command = [sys.executable, "-m", "pytest", "-m", "parity", "-q", *xdist, f"--junitxml={junit}", *select]
    start = time.monotonic()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    suite = ET.parse(junit).getroot().find("testsuite") if junit.exists() else None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} if suite is not None else {}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in (suite.iter("testcase") if suite is not None else [])
        if case.find("failure") is not None or case.find("error") is not None
    ]
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return {
        "capability": capability,
        "used": used_capability(env),
        "returncode": result.returncode,
        "wall_s": wall,
        "counts": counts,
        "failed": failed,
        "records": records,
        "tail": result.stdout[-2000:],
    }


def largest_by_test(records: list[dict]) -> dict[str, dict]:
    """Each test's record that used the largest share of its tolerance."""
    worst: dict[str, dict] = {}
    for record in records:
        if record["test"] not in worst or record["used"] > worst[record["test"]]["used"]:
            worst[record["test"]] = record
    return worst


def tolerance_text(tolerance) -> str:
    if isinstance(tolerance, dict):
        rtol = f" + {tolerance['rtol']:.1g}·|x|" if tolerance.get("rtol") else ""
        return f"{tolerance['atol']:.2g}{rtol}"
    return f"{tolerance:.2g}"


def report(runs: list[dict], model: str, flags: list[str], workers: int, concurrent: bool) -> str:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    workers_text = f"-n {workers} --dist loadfile" if workers else "-p no:xdist"
    lines = [
        "# Parity tests under each ATEN_CPU_CAPABILITY",
        "",
        "`python benchmarks/parity_capabilities.py"
        + (f" --workers {workers}" if workers != 2 else "")
        + (" --concurrent" if concurrent else "")
        + f"`: `pytest -m parity {workers_text}` with OMP_NUM_THREADS=1, once per capability"
        + (", the capabilities running at the same time" if concurrent else "")
        + " (the torchrun workers the tests start inherit it). Deviation: the largest |ours − reference| of the "
        "comparison that used the largest share of its tolerance in that test; used = deviation / tolerance.",
        "",
        f"- CPU: {model}; flags: {', '.join(flags) or 'none of ' + ', '.join(FLAGS)}",
        f"- torch {torch.__version__}, Python {platform.python_version()}, commit {commit.stdout.strip()}"
        + (" (with uncommitted changes)" if dirty else ""),
        f"- {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, a 2-core machine shared with other work "
        "(wall times are indicative only)",
        "",
        "| capability (torch reports) | passed | failed | errors | skipped | wall |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        c = r["counts"]
        passed = c.get("tests", 0) - c.get("failures", 0) - c.get("errors", 0) - c.get("skipped", 0)
        lines.append(
            f"| {r['capability']} ({r['used']}) | {passed} | {c.get('failures', '?')} | {c.get('errors', '?')} "
            f"| {c.get('skipped', '?')} | {r['wall_s'] / 60:.1f} min |"
        )
    for r in runs:
        if r["failed"]:
            lines += ["", f"Failed under {r['capability']}:", *(f"- `{name}`" for name in r["failed"])]
    worst = [largest_by_test(r["records"]) for r in runs]
    tests = sorted(set().union(*worst))
    lines += [
        "",
        "## Largest deviation per test",
        "",
        "| test | what | tolerance | " + " | ".join(f"{r['capability']}: deviation (used)" for r in runs) + " |",
        "|---|---|---|" + "---|" * len(runs),
    ]
    for test in tests:
        first = next(w[test] for w in worst if test in w)
        cells = [f"{w[test]['deviation']:.2g} ({w[test]['used']:.2g})" if test in w else "—" for w in worst]
        name = test.removeprefix("tests/")
        lines.append(
            f"| `{name}` | {first['what']} | {tolerance_text(first['tolerance'])} | " + " | ".join(cells) + " |"
        )
    overall = [max((rec["used"] for rec in r["records"]), default=0.0) for r in runs]
    lines += [
        "",
        "Largest share of a tolerance used: " + ", ".join(f"{r['capability']} {u:.2g}" for r, u in zip(runs, overall)),
    ]
    return "\n".join(lines) + "\n"


def write(out: Path, runs: list[dict], model: str, flags: list[str], workers: int, concurrent: bool) -> None:
    """The report, and beside it each run's counts and largest deviation per test as JSON."""
    out.write_text(report(runs, model, flags, workers, concurrent))
    summary = [
        {**{k: v for k, v in r.items() if k != "records"}, "largest": largest_by_test(r["records"])} for r in runs
    ]
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (0 = none)")
    parser.add_argument("--capabilities", nargs="*", help="default: every one this CPU has")
    parser.add_argument("--concurrent", action="store_true", help="run the capabilities at the same time")
    parser.add_argument("-k", dest="select", help="only the parity tests matching this pytest -k expression")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "parity_cpu_capabilities.md")
    args = parser.parse_args()
    model, flags = cpu_info()
    chosen = args.capabilities or capabilities(flags)
    runs: list[dict] = []
    scratch = tempfile.mkdtemp(prefix="parity-capabilities-")  # kept: each capability's JSON lines and junit XML
    select = ["-k", args.select] if args.select else []
    with concurrent.futures.ThreadPoolExecutor(len(chosen)) as pool:
        width = len(chosen) if args.concurrent else 1
        for first in range(0, len(chosen), width):
            batch = chosen[first : first + width]
            print(f"parity tests under ATEN_CPU_CAPABILITY={', '.join(batch)} …", flush=True)
            for r in pool.map(lambda c: run(c, args.workers, Path(scratch), select), batch):
                runs.append(r)
                print(f"  {r['capability']}: {r['counts']} in {r['wall_s']:.0f} s (torch: {r['used']})", flush=True)
                for name in r["failed"]:
                    print(f"  failed: {name}", flush=True)
            write(args.out, runs, model, flags, args.workers, args.concurrent)  # an interrupted run keeps these
    print(f"wrote {args.out} (raw records in {scratch})")
    return 0 if all(r["returncode"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
