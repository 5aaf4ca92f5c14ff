"""Tokens/s and MFU of `forge train` for a preset and a parallel layout, measured as a user runs it.

Each variant is one `forge train PRESET --nproc-per-node N [overrides]` into a fresh run directory;
throughput and MFU are read back from its metrics.jsonl, leaving out the first steps (compilation,
allocator warm-up). Variants run one after another in the same job, so their ratio compares like with
like: the first variant is the reference.

  python benchmarks/bench_layout.py presets/debug.toml --steps 60 \\
      --variant "bf16=--train.mixed_precision=bf16" \\
      --variant "fp8=--train.mixed_precision=fp8 --train.compile_model=true"
  python benchmarks/bench_layout.py presets/debug.toml --nproc-per-node 8 --variant "fsdp8=" \\
      --variant "tp2=--distributed.tp=2"
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_variant(preset: str, nproc: int, steps: int, overrides: list[str], run_dir: Path) -> dict:
    command = [
        sys.executable,
        "-m",
        "forgecli.app",
        "train",
        preset,
        "--run-dir",
        str(run_dir),
        f"--train.max_steps={steps}",
        "--metrics.log_interval=1",
        "--eval.enabled=false",
        "--scheduler.warmup_steps=1",
        *overrides,
    ]
    if nproc > 1:
        command.append(f"--nproc-per-node={nproc}")
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{shlex.join(command)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return summarize([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])


def summarize(records: list[dict]) -> dict:
    steps = [r for r in records if "tokens_per_sec" in r]
    steady = steps[len(steps) // 4 :] or steps  # the first quarter warms up
    per_rank = {k: v for k, v in steady[-1].items() if k.startswith("mem_peak_gib")}
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    return {
        "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in steady),
        "mfu": statistics.median(mfus) if mfus else None,
        "final_loss": steps[-1]["loss"],
        "steps_measured": len(steady),
        **per_rank,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset")
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME=OVERRIDES (space-separated forge overrides); the first is the reference",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    args = parser.parse_args()
    variants = [v.split("=", 1) for v in args.variant or ["default="]]
    report = {"preset": args.preset, "nproc_per_node": args.nproc_per_node, "steps": args.steps, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in variants:
            report["variants"][name] = run_variant(
                args.preset, args.nproc_per_node, args.steps, shlex.split(overrides), Path(tmp) / name
            )
    reference = next(iter(report["variants"].values()))["tokens_per_sec"]
    for result in report["variants"].values():
        result["speed_vs_first"] = result["tokens_per_sec"] / reference
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
