"""Multi-token prediction on the embedded corpus: does each depth's loss fall? (issue 30)

Trains presets/deepseek_v3_small.toml scaled down to CPU size (group-limited sigmoid routing, shared expert,
MTP), with --mtp-depth modules, for --steps steps, one process, and prints the main loss and each depth's
(`loss_main`, `mtp/loss_{k}` of metrics.jsonl, each the mean over its step) at a few steps, as a markdown
table; exits 1 unless every one of them fell from the mean of the first 10 steps to the mean of the last 10.

    OMP_NUM_THREADS=1 python benchmarks/mtp_losses.py --steps 100 --mtp-depth 2 --run-dir runs/mtp_losses
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = [
    "distributed.ep=1",
    "model.dim=128",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.n_layers=3",
    "model.vocab_size=4096",
    "model.max_seq_len=128",
    "train.batch_size=4",
    "train.seq_len=128",
    "train.grad_accum_steps=1",
    "train.mixed_precision=fp32",
    "scheduler.warmup_steps=10",
    "eval.enabled=false",
    "checkpoint.interval=100000",
    "metrics.log_interval=1",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--mtp-depth", type=int, default=2)
    parser.add_argument("--run-dir", type=Path, default=REPO / "runs" / "mtp_losses")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from engine.config import load_job_config
    from engine.train.trainer import train

    overrides = [*SHAPE, f"train.max_steps={args.steps}", f"model.mtp_depth={args.mtp_depth}"]
    train(load_job_config(REPO / "presets" / "deepseek_v3_small.toml", overrides), args.run_dir)
    lines = (args.run_dir / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "loss" in r]
    keys = ["loss", "loss_main", *(f"mtp/loss_{k}" for k in range(1, args.mtp_depth + 1))]
    print("| step | " + " | ".join(f"`{k}`" for k in keys) + " |")
    print("|---:|" + "---:|" * len(keys))
    shown = sorted({1, 10, 25, 50, 75, args.steps} & {r["step"] for r in records})
    for r in records:
        if r["step"] in shown:
            print(f"| {r['step']} | " + " | ".join(f"{r[k]:.3f}" for k in keys) + " |")
    fell = True
    for key in keys[1:]:
        first = sum(r[key] for r in records[:10]) / 10
        last = sum(r[key] for r in records[-10:]) / 10
        print(f"{key}: mean of steps 1-10 {first:.3f} → of the last 10 {last:.3f}")
        fell &= last < first
    return 0 if fell else 1


if __name__ == "__main__":
    sys.exit(main())
