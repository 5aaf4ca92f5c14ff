"""Tokens/s of one MoE feed-forward (router + experts, forward + backward): grouped vs looped experts.

    python benchmarks/bench_moe.py [--experts 4 8 16 32] [--tokens 4096] [--dim 256] [--hidden 256]
                                   [--top-k 2] [--device cpu|cuda] [--dtype fp32|bf16] [--out moe.json]

The two implementations compute the same thing (tests/model/test_moe.py holds them equal): `grouped` sorts the
(token, expert) assignments by expert and runs each projection as one grouped matrix multiply;
`loop` runs one expert at a time. Same module, same weights, same batch; they are timed in
alternating rounds after warm-up steps, and the median step is reported.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from bench_args import emit

from engine.config.model import ModelConfig
from engine.model.moe import GROUPED_MM, MoE

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per step (batch × seq)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256, help="width of one expert")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", help="write the result as JSON here")
    return p.parse_args()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step(moe: MoE, x: torch.Tensor) -> None:
    out, stats = moe(x)
    (out.float().square().mean() + stats.loss).backward()


def timed(moe: MoE, x: torch.Tensor, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        sync(x.device)
        start = time.perf_counter()
        step(moe, x)
        sync(x.device)
        times.append(time.perf_counter() - start)
    return times


def bench(args: argparse.Namespace, experts: int) -> dict:
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    dim = args.dim
    cfg = ModelConfig(dim=dim, n_heads=1, num_experts=experts, moe_top_k=args.top_k, ffn_hidden_dim=args.hidden)
    torch.manual_seed(0)
    moe = MoE(cfg).to(device=device, dtype=dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, args.tokens, dim, device=device, dtype=dtype, requires_grad=True)
    implementations = ["grouped", "loop"] if GROUPED_MM is not None else ["loop"]
    times: dict[str, list[float]] = {name: [] for name in implementations}
    for name in implementations:
        moe.implementation = name
        timed(moe, x, args.warmup)
    for _ in range(args.rounds):
        for name in implementations:
            moe.implementation = name
            times[name] += timed(moe, x, args.steps)
    result = {"experts": experts}
    for name, samples in times.items():
        median = statistics.median(samples)
        result[name] = {"step_ms": round(1000 * median, 2), "tokens_per_sec": round(args.tokens / median)}
    if "grouped" in result:
        result["speedup"] = round(result["loop"]["step_ms"] / result["grouped"]["step_ms"], 2)
    return result


def main() -> None:
    args = parse_args()
    setup = {k: v for k, v in vars(args).items() if k != "out"}
    report = {
        "setup": setup,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "results": [bench(args, e) for e in args.experts],
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
