"""Context parallelism on CPU (gloo): activations per rank against sequence length for cp = 1 and 2, and the
time of a training step of each `distributed.cp_method` at cp = 2 against one process on the whole sequence.

Runs itself on 2 processes under torchrun. Activation memory is what autograd saves in one forward + loss
(saved-tensor hooks, distinct storages, parameters excluded): the activations a rank holds when backward
starts, its peak under training. The memory estimate of `forge validate-config --world-size` is printed
beside it. The step times alternate rounds of the four variants (one process on the whole sequence,
allgather, ring, ulysses) in the same processes, so a load change on the machine hits them alike; each
variant's median per step is reported with its ratio to one process.

  python benchmarks/bench_context_parallel.py --seq-lens 256 512 1024 2048 --time-seq-len 1024 \\
      --rounds 3 --steps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from engine.plan import check_config

REPO = Path(__file__).resolve().parents[1]
METHODS = ("allgather", "ring", "ulysses")
MODEL = [
    "--model.dim=128",
    "--model.n_layers=2",
    "--model.n_heads=8",
    "--model.n_kv_heads=2",
    "--model.vocab_size=512",
    "--train.batch_size=1",
    "--model.sdpa_backend=flash",
]


def job_config(seq_len: int, cp: int, method: str):
    from engine.config import load_job_config

    layout = ["--distributed.cp=2", "--distributed.dp_shard=1", f"--distributed.cp_method={method}"] if cp > 1 else []
    overrides = [*MODEL, f"--train.seq_len={seq_len}", f"--model.max_seq_len={seq_len}", *layout]
    return check_config(load_job_config(None, overrides), world_size=cp)


def saved_bytes(model, loss_fn, tokens, labels) -> int:
    import torch
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        data = t.elem if isinstance(t, AsyncCollectiveTensor) else t  # a collective's result, maybe in flight
        storage = data.untyped_storage()
        if storage.data_ptr() not in state:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(model, tokens, labels)
    return sum(seen.values())


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from engine.model.transformer import Transformer
    from engine.parallel.apply import parallelize
    from engine.parallel.context import ContextParallel, apply_context_parallel
    from engine.parallel.memory import estimate_memory
    from engine.parallel.mesh import ParallelDims, build_mesh
    from engine.train.losses import build_loss
    from engine.train.optim import build_optimizer

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    meshes = {}

    def variant(seq_len: int, method: str | None, *, fsdp: bool = True):
        """(model, optimizer, loss, shard, config) for one process (method None) or cp = 2; without `fsdp`
        only the cp attention is applied (what the memory table measures: FSDP's gathered weights are saved
        for backward too, and are not activations)."""
        cfg = job_config(seq_len, 1 if method is None else 2, method or "allgather")
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        if method is None:
            return model, build_optimizer(model, cfg.optimizer), build_loss(cfg.train), lambda t: t, cfg
        if method not in meshes:
            meshes[method] = build_mesh(ParallelDims.from_config(cfg.distributed, 2), "cpu")
        cp_mesh = meshes[method].get("cp")
        if fsdp:
            model = parallelize(model, cfg, meshes[method])
        else:
            apply_context_parallel(model, cp_mesh, method, torch.device("cpu"))
        cp = ContextParallel(cp_mesh)
        return model, build_optimizer(model, cfg.optimizer), build_loss(cfg.train), cp.shard, cfg

    def batch(seq_len: int):
        tokens = torch.randint(0, 512, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
        return tokens[:, :-1], tokens[:, 1:]

    memory = []
    for seq_len in args.seq_lens:
        inputs, labels = batch(seq_len)
        for method in (None, *METHODS):
            model, _, loss_fn, shard, cfg = variant(seq_len, method, fsdp=False)
            measured = torch.tensor([saved_bytes(model, loss_fn, shard(inputs), shard(labels))], dtype=torch.float64)
            dist.all_reduce(measured, op=dist.ReduceOp.MAX)
            [stage] = estimate_memory(cfg, 1 if method is None else 2)
            memory.append(
                {
                    "seq_len": seq_len,
                    "cp": 1 if method is None else 2,
                    "method": method or "-",
                    "saved_mib": measured.item() / 2**20,
                    "estimate_mib": stage.activations / 2**20,
                }
            )

    variants = {
        name: variant(args.time_seq_len, name if name != "one process" else None) for name in ("one process", *METHODS)
    }
    inputs, labels = batch(args.time_seq_len)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (model, optimizer, loss_fn, shard, _) in variants.items():
            for step in range(args.steps + 1):  # the first step of a round warms up
                dist.barrier()
                started = time.perf_counter()
                loss_fn(model, shard(inputs), shard(labels)).backward()
                optimizer.step()
                optimizer.zero_grad()
                elapsed = torch.tensor([time.perf_counter() - started])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts until its slowest rank is done
                if step:
                    times[name].append(elapsed.item())
    if rank == 0:
        Path(args.worker).write_text(json.dumps({"memory": memory, "times": times}))
    dist.barrier()
    dist.destroy_process_group()
    from engine.parallel.launch import end_process

    end_process(0)


def report(result: dict, args: argparse.Namespace) -> str:
    lines = [
        "Activations saved for backward per rank (MiB, max over the 2 ranks) and the estimate:",
        "",
        "| seq_len | cp | method | measured | estimate | measured / cp=1 |",
        "|---|---|---|---|---|---|",
    ]
    base = {row["seq_len"]: row["saved_mib"] for row in result["memory"] if row["cp"] == 1}
    for row in result["memory"]:
        lines.append(
            f"| {row['seq_len']} | {row['cp']} | {row['method']} | {row['saved_mib']:.2f} | "
            f"{row['estimate_mib']:.2f} | {row['saved_mib'] / base[row['seq_len']]:.2f} |"
        )
    one = statistics.median(result["times"]["one process"])
    lines += [
        "",
        f"Time per training step at seq_len {args.time_seq_len} (median of {args.rounds} × {args.steps} steps):",
        "",
        "| variant | ms / step | ratio to one process |",
        "|---|---|---|",
    ]
    for name, values in result["times"].items():
        median = statistics.median(values)
        lines.append(f"| {name} | {1000 * median:.1f} | {median / one:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--time-seq-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(f"/tmp/bench_context_parallel_{int(time.time())}.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__]
    forwarded = ["--seq-lens", *map(str, args.seq_lens), "--time-seq-len", str(args.time_seq_len)]
    forwarded += ["--rounds", str(args.rounds), "--steps", str(args.steps), "--worker", str(out)]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    subprocess.run([*command, *forwarded], check=True, env={**__import__("os").environ, **env})
    print(report(json.loads(out.read_text()), args))


if __name__ == "__main__":
    main()
