"""Peak extra memory of the loss (forward + backward) for plain vs chunked cross-entropy.

Each loss runs in its own fresh subprocess, so one measurement cannot reuse the other's freed memory.
"Extra" is what the loss itself needs beyond its inputs (hidden states, head weight, labels): on CPU the
peak resident set (getrusage ru_maxrss) minus the resident set just before the loss; on CUDA
torch.cuda.max_memory_allocated minus the memory allocated just before. Gradients of the hidden states
and of the head are part of both. The time of forward + backward is reported too.

    python benchmarks/bench_chunked_ce.py                                  # vocab 50257 × 8192 tokens, CPU
    python benchmarks/bench_chunked_ce.py --chunk-size 2048 --z-loss 1e-4
    python benchmarks/bench_chunked_ce.py --device cuda --dim 4096
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time

from bench_args import emit


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Run one loss once (in this process) and return its extra memory and time."""
    import torch

    from engine.train.losses import chunked_cross_entropy, cross_entropy

    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.tokens, args.dim, device=device, generator=g, requires_grad=True)
    weight = (torch.randn(args.vocab, args.dim, device=device, generator=g) * args.dim**-0.5).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=g)

    def loss() -> torch.Tensor:
        if args.loss == "plain":
            return cross_entropy((hidden @ weight.T)[None], labels[None], args.z_loss)
        return chunked_cross_entropy(hidden[None], weight, labels[None], args.chunk_size, args.z_loss)

    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = resident_bytes()
    start = time.perf_counter()
    value = loss()
    value.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "extra_bytes": peak - before,
        "seconds": time.perf_counter() - start,
        "loss": value.item(),
        "grad_weight_norm": weight.grad.norm().item(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dim", type=int, default=256, help="hidden size (does not change the logits' size)")
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--z-loss", type=float, default=0.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--loss", choices=["plain", "chunked"], help=argparse.SUPPRESS)  # set in the subprocesses
    p.add_argument("--out", help="write the result as JSON here")
    args = p.parse_args()
    if args.loss:
        print(json.dumps(measure(args)))
        return

    import torch

    results = {}
    for loss in ("plain", "chunked"):
        command = [sys.executable, __file__, *sys.argv[1:], "--loss", loss]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        results[loss] = json.loads(out.strip().splitlines()[-1])
    gib = 2**30
    logits_gib = args.tokens * args.vocab * 4 / gib
    report = {
        "setup": {
            "vocab": args.vocab,
            "tokens": args.tokens,
            "dim": args.dim,
            "chunk_size": args.chunk_size,
            "z_loss": args.z_loss,
            "device": args.device,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
        },
        "fp32_logits_gib": logits_gib,
        **{loss: {**r, "extra_gib": r["extra_bytes"] / gib} for loss, r in results.items()},
        "memory_ratio_chunked_over_plain": results["chunked"]["extra_bytes"] / results["plain"]["extra_bytes"],
        "loss_difference": abs(results["chunked"]["loss"] - results["plain"]["loss"]),
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
