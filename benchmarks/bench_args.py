"""What the model benchmarks share: the model-shape and timing flags, and writing the JSON report.

Imported by sibling scripts run as `python benchmarks/bench_*.py` (their folder is on sys.path).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from engine.config.model import ModelConfig
from engine.precision import COMPUTE_DTYPES


def model_parser(doc: str | None, batch_size: int, warmup: int, steps: int) -> argparse.ArgumentParser:
    """Flags for the debug-preset shape by default, the device and dtype, and the timing rounds."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=6)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=list(COMPUTE_DTYPES), default="fp32")
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--steps", type=int, default=steps, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", help="write the result as JSON here")
    return p


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        vocab_size=args.vocab_size,
        max_seq_len=args.seq_len,
    )


def emit(report: dict[str, Any], out: str | None) -> None:
    """Print the report, and write it to `out` when given."""
    print(json.dumps(report, indent=2))
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
