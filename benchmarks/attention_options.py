"""The gated attention output and attention sinks on the debug shape: loss with neither, each, and both (issue 51)

Trains `presets/debug.toml` (its model, data, schedule and batch) for --steps steps once per variant and seed,
each run a `forge train` of its own, one after another, and prints one markdown table, a row per variant
and seed: the mean training loss of the last 50 steps, the eval loss at the end, the largest step-to-step
rise of the training loss after step 50 (a loss spike; the preset warms up for 20), and the median tokens/s
relative to "neither" of the same seed.

    OMP_NUM_THREADS=1 python benchmarks/attention_options.py --steps 500 --seeds 1,2 --work runs/attention_options
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "neither": [],
    "gate": ["--model.attention_output_gate=true"],
    "sinks": ["--model.attention_sinks=true"],
    "both": ["--model.attention_output_gate=true", "--model.attention_sinks=true"],
}


def run(variant: str, seed: int, steps: int, work: Path) -> dict:
    run_dir = work / f"{variant}_seed{seed}"
    command = [
        str(Path(sys.executable).with_name("forge")),
        "train",
        str(REPO / "presets" / "debug.toml"),
        *VARIANTS[variant],
        f"--train.max_steps={steps}",
        f"--train.seed={seed}",
        f"--eval.interval={steps}",
        "--metrics.log_interval=1",
        f"--checkpoint.interval={steps}",
        "--run-dir",
        str(run_dir),
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=os.environ)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    warm = [r["loss"] for r in train if r["step"] > 50]
    return {
        "last50": statistics.mean(r["loss"] for r in train[-50:]),
        "eval": [r["eval_loss"] for r in records if "eval_loss" in r][-1],
        "spike": max(b - a for a, b in itertools.pairwise(warm)),
        "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in train[10:]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "attention_options")
    parser.add_argument("--json", type=Path, help="also write the per-run numbers here")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    results = {(v, s): run(v, s, args.steps, args.work) for s in seeds for v in VARIANTS}
    if args.json:
        args.json.write_text(json.dumps({f"{v}/seed{s}": r for (v, s), r in results.items()}, indent=1))
    print(
        "| variant | seed | train loss, last 50 steps | eval loss | largest rise after step 50 | tokens/s vs neither |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for variant in VARIANTS:
        for seed in seeds:
            r, ref = results[variant, seed], results["neither", seed]
            print(
                f"| {variant} | {seed} | {r['last50']:.4f} | {r['eval']:.4f} | {r['spike']:.3f} | "
                f"{r['tokens_per_sec'] / ref['tokens_per_sec']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
