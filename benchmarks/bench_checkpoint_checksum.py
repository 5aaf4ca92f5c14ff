"""What the checksums of a checkpoint's files cost: a synchronous save with and without them, and the stall of
the two async modes with and without them (there the files are summed in the background, after they are
written), plus how fast `forge checkpoint verify` reads a checkpoint back.

    python benchmarks/bench_checkpoint_checksum.py [--dim 512 --layers 8 --vocab 32000] [--repeats 3]

"Without" replaces `engine.checkpoint.dcp.record_rank_checksums` (each rank summing its own shards) by a
no-op; the train state's checksum, a few kilobytes, stays. The stall is what bench_checkpoint.py measures:
the `save` call, plus the wait for the background copy after one forward/backward ran beside it. "Step" is
that whole step (save + forward/backward + wait): on a CPU the background writer and summing compete with
the step's compute for the same cores. Runs alternate with/without; every figure is the best of the repeats.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import time
from pathlib import Path

import torch

from engine.checkpoint import dcp
from engine.checkpoint.manager import Checkpointer
from engine.checkpoint.verify import verify_checkpoint
from engine.config.checkpoint import CheckpointConfig
from engine.config.model import ModelConfig
from engine.config.optimizer import OptimizerConfig
from engine.model import build_model
from engine.train.optim import build_optimizer

MODES = ("disabled", "async", "async_with_pinned_mem")


def forward_backward(model: torch.nn.Module, tokens: torch.Tensor) -> None:
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()


def one_save(root: Path, mode: str, step: int, model: torch.nn.Module, optimizer, tokens) -> tuple[float, float]:
    """(stall, step time) of one save in `mode`."""
    ckpt = Checkpointer(root, CheckpointConfig(async_mode=mode, keep_last_n=1), torch.device("cpu"))
    start = time.perf_counter()
    ckpt.save(step, model, optimizer, {"step": step})
    stall = time.perf_counter() - start
    forward_backward(model, tokens)
    waited = time.perf_counter()
    ckpt.wait_for_staging()
    stall += time.perf_counter() - waited
    step_time = time.perf_counter() - start
    optimizer.zero_grad()
    ckpt.wait()
    return stall, step_time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/forge-bench-checksum"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    cfg = ModelConfig(
        dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64, vocab_size=args.vocab, max_seq_len=128
    )
    model = build_model(cfg)
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-4))
    tokens = torch.randint(0, args.vocab, (1, 128))
    forward_backward(model, tokens)
    optimizer.step()
    optimizer.zero_grad()

    shutil.rmtree(args.dir, ignore_errors=True)
    record = dcp.record_rank_checksums
    stalls = {(mode, on): [] for mode in MODES for on in (True, False)}
    steps = {key: [] for key in stalls}
    step = 0
    for _ in range(args.repeats):
        for mode in MODES:
            for on in (False, True):
                step += 1
                dcp.record_rank_checksums = record if on else (lambda path, rank: None)
                stall, step_time = one_save(args.dir / mode, mode, step, model, optimizer, tokens)
                stalls[mode, on].append(stall)
                steps[mode, on].append(step_time)
    dcp.record_rank_checksums = record
    folder = dcp.complete_checkpoints(args.dir / "disabled")[-1][1]  # a sync save's, with checksums
    size = sum(p.stat().st_size for p in folder.iterdir())
    verify = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        assert verify_checkpoint(folder)
        verify.append(time.perf_counter() - start)
    shutil.rmtree(args.dir, ignore_errors=True)

    params = sum(p.numel() for p in model.parameters())
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus; torch {torch.__version__}")
    print(f"model: {params / 1e6:.1f}M parameters; checkpoint {size / 2**30:.2f} GiB (weights + AdamW moments)")
    print(f"verify (read back + CRC-32): {min(verify):.2f} s = {size / min(verify) / 2**20:.0f} MiB/s")
    print("mode | stall without | stall with | stall increase | step without | step with")
    for mode in MODES:
        off, on = min(stalls[mode, False]), min(stalls[mode, True])
        print(
            f"{mode} | {off:.3f} s | {on:.3f} s | {(on - off) / off:+.1%} | "
            f"{min(steps[mode, False]):.3f} s | {min(steps[mode, True]):.3f} s"
        )


if __name__ == "__main__":
    main()
