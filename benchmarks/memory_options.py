"""The memory options on the debug preset: the loss curve of each against fp32 AdamW, and its step time.

Trains `presets/debug.toml` (300 steps on the embedded corpus) once per option through `engine.train.trainer`,
exactly as `forge train` does (torchao's 8-bit step compiled, as in training), and reports the final training
loss (the mean of the last 20 logged steps, which smooths the batch-to-batch noise), the last evaluation loss,
the largest gap to fp32 AdamW at any logged step and the median tokens per second (the first step, with its compilation, left out).

    python benchmarks/memory_options.py --out memory_options.json
    python benchmarks/memory_options.py --steps 100 --option int8
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine.config import load_job_config
from engine.train.trainer import train

PRESET = Path(__file__).parents[1] / "presets" / "debug.toml"
OPTIONS = {
    "fp32": [],
    "int8": ["optimizer.state_dtype=int8"],
    "activation_offload+full_ac": ["train.activation_offload=true", "train.activation_checkpointing=full"],
    "fp32_bf16_compute": ["train.mixed_precision=bf16"],
    "bf16_weights": ["optimizer.weight_dtype=bf16", "optimizer.state_dtype=bf16", "train.mixed_precision=bf16"],
    "bf16_weights_int8": ["optimizer.weight_dtype=bf16", "optimizer.state_dtype=int8", "train.mixed_precision=bf16"],
}
BASELINE = {"bf16_weights": "fp32_bf16_compute", "bf16_weights_int8": "fp32_bf16_compute"}
"""What each option is compared with (default fp32): bf16 weights against fp32 weights with the same bf16 compute."""


def run(name: str, overrides: list[str], steps: int, root: Path) -> dict:
    cfg = load_job_config(PRESET, [f"train.max_steps={steps}", "metrics.log_interval=1", *overrides])
    print(f"{name}: {' '.join(overrides)}", flush=True)
    started = time.perf_counter()
    train(cfg, root / name)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    return {
        "overrides": overrides,
        "losses": [r["loss"] for r in steps_],
        "final_train_loss": statistics.fmean(r["loss"] for r in steps_[-20:]),
        "eval_loss": evals[-1]["eval_loss"] if evals else None,
        "median_tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in steps_[1:]),
        "wall_sec": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--option", action="append", choices=list(OPTIONS), help="default: all")
    p.add_argument("--set", action="append", default=[], help="an override for every run, e.g. model.dim=64")
    p.add_argument("--out", help="write the result as JSON here")
    args = p.parse_args()
    names = args.option or list(OPTIONS)
    for name in list(names):
        base = BASELINE.get(name, "fp32")
        if base not in names:
            names.insert(0, base)
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(name, [*args.set, *OPTIONS[name]], args.steps, Path(tmp)) for name in names}
    for name, r in results.items():
        base = BASELINE.get(name, "fp32")
        r["baseline"] = base
        r["max_gap_to_baseline"] = max(abs(a - b) for a, b in zip(r["losses"], results[base]["losses"]))
        r["final_gap_to_baseline"] = r["final_train_loss"] - results[base]["final_train_loss"]
    for r in results.values():
        r["losses"] = [round(x, 5) for x in r["losses"]]
    report = {
        "setup": {
            "preset": "presets/debug.toml",
            "steps": args.steps,
            "set": args.set,
            "threads": torch.get_num_threads(),
        },
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "machine": platform.processor() or platform.machine(),
        "results": results,
    }
    try:
        import torchao

        report["versions"]["torchao"] = torchao.__version__
    except ImportError:
        pass
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
