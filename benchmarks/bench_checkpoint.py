"""Checkpoint cost on the training loop: synchronous save vs the stall of the two async modes, and save
throughput against the disk's own sequential write speed measured in the same run and folder.

    python benchmarks/bench_checkpoint.py [--dim 768 --layers 12 --vocab 32000] [--dir /tmp/forge-bench-ckpt]

The model (~110M parameters at the defaults) is trained one step first so AdamW has its moments; a
checkpoint then holds weights + two moments (about 12 bytes per parameter in fp32). For each mode the
stall is the time the loop is blocked: the `save` call, plus (async_with_pinned_mem) the wait for the
background copy after one forward/backward has run beside it.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import time
from pathlib import Path

import torch

from engine.checkpoint.manager import Checkpointer
from engine.config.checkpoint import CheckpointConfig
from engine.config.model import ModelConfig
from engine.config.optimizer import OptimizerConfig
from engine.model import build_model
from engine.model.transformer import Transformer
from engine.train.optim import build_optimizer


def disk_write_speed(folder: Path, total_bytes: int, chunk: int = 64 << 20) -> float:
    """Bytes/s of a plain sequential write + fsync of `total_bytes` into `folder`."""
    path = folder / "disk_probe.bin"
    block = os.urandom(chunk)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(total_bytes // chunk, 1)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return max(total_bytes // chunk, 1) * chunk / elapsed


def forward_backward(model: Transformer, tokens: torch.Tensor) -> float:
    start = time.perf_counter()
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    return time.perf_counter() - start


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/forge-bench-ckpt"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--device", default="cpu", help="where the model and optimizer live (cuda: staging copies to host)"
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    cfg = ModelConfig(
        dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64, vocab_size=args.vocab, max_seq_len=128
    )
    device = torch.device(args.device)
    model = build_model(cfg).to(device)
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-4))
    tokens = torch.randint(0, args.vocab, (1, 128), device=device)
    forward_backward(model, tokens)
    optimizer.step()
    optimizer.zero_grad()
    params = sum(p.numel() for p in model.parameters())

    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    results: dict[str, list[float]] = {"disabled": [], "async": [], "async_with_pinned_mem": []}
    totals: dict[str, list[float]] = {k: [] for k in results}
    size = 0
    step = 0
    for _ in range(args.repeats):
        for mode in results:
            step += 1
            ckpt = Checkpointer(args.dir / mode, CheckpointConfig(async_mode=mode, keep_last_n=1), device)
            start = time.perf_counter()
            ckpt.save(step, model, optimizer, {"step": step})
            stall = time.perf_counter() - start
            forward_backward(model, tokens)  # the next step's compute, beside the background work
            if device.type == "cuda":
                torch.cuda.synchronize()
            waited = time.perf_counter()
            ckpt.wait_for_staging()
            stall += time.perf_counter() - waited
            optimizer.zero_grad()
            ckpt.wait()
            results[mode].append(stall)
            totals[mode].append(time.perf_counter() - start)
            size = folder_bytes(args.dir / mode / f"step_{step}")
    disk = max(disk_write_speed(args.dir, size) for _ in range(args.repeats))  # the disk at its best, as for saves

    sync = min(results["disabled"])  # best of the repeats, for every mode alike
    gpu = f"; {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus{gpu}; torch {torch.__version__}"
    )
    print(f"model: {params / 1e6:.1f}M parameters; checkpoint {size / 2**30:.2f} GiB (weights + AdamW moments)")
    print(f"disk sequential write + fsync (best of {args.repeats}): {disk / 2**20:.0f} MiB/s")
    print(f"sync save: {sync:.2f} s = {size / sync / 2**20:.0f} MiB/s ({size / sync / disk:.2f}× the disk)")
    for mode in ("async", "async_with_pinned_mem"):
        stall = min(results[mode])
        print(
            f"{mode}: stall {stall:.3f} s = {stall / sync:.1%} of sync save; save done after {min(totals[mode]):.2f} s"
        )
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
