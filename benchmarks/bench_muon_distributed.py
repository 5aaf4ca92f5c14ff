"""Muon's optimizer step under FSDP: each matrix orthogonalized once, by its owner, against every rank
gathering and orthogonalizing every matrix (issue 52)

Launches itself with torchrun for each process count (gloo on CPU, or nccl with --device cuda): a Forge
transformer of --dim × --layers under FSDP2 over all ranks, random gradients, and --steps optimizer steps of
each method, alternating in one job (the reference first), timed with a barrier around each step. Prints a
markdown row per process count: the median step time of each method, their ratio, and the bytes each rank
receives per step for the hidden matrices (from the shapes: the all-gather's (N − 1)/N of every matrix, against
the owners' rows in and their results' rows out).

    OMP_NUM_THREADS=1 python benchmarks/bench_muon_distributed.py --procs 1,2,4 --dim 256 --layers 4 --steps 6

torchtitan 0.3.0's `DistMuon` (torchtitan/distributed/flex_shard/) is not run: it needs its own FlexShard
parameter storage (`compute_sharding_by_fqn`, `BucketConfig`), not FSDP2's DTensors.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO))
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from engine.config.model import ModelConfig
    from engine.config.optimizer import OptimizerConfig
    from engine.model.transformer import Transformer
    from engine.parallel.apply import apply_fsdp
    from engine.train.optim import build_optimizer
    from engine.train.optim.groups import hidden_matrices
    from engine.train.optim.muon import Muon, orthogonalize
    from engine.train.optim.muon_distributed import assign_owners, newton_schulz_flops

    class GatherEverywhere(Muon):
        """The first Muon: every rank gathers every matrix, orthogonalizes it, keeps its shard."""

        def _orthogonalized(self, matrices):
            out = []
            for p, group, nesterov in matrices:
                full = orthogonalize(nesterov.full_tensor(), group["ns_steps"], self._ns_dtype(p)).to(nesterov.dtype)
                out.append(distribute_tensor(full, nesterov.device_mesh, nesterov.placements, src_data_rank=None))
            return out

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, rank if args.device == "cuda" else 0)
    if args.device == "cuda":
        torch.cuda.set_device(device)
    cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64, vocab_size=4096, max_seq_len=64)
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(cfg)
    mesh = init_device_mesh(args.device, (n,), mesh_dim_names=("dp_shard",))
    apply_fsdp(model, mesh, torch.float32)
    optimizer = build_optimizer(model, OptimizerConfig.model_validate({"name": "muon"}))
    reference = GatherEverywhere(optimizer.param_groups, ns_dtype=optimizer.ns_dtype)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    times = {"gather_everywhere": [], "owners": []}
    for _ in range(args.steps):
        for name, opt in (("gather_everywhere", reference), ("owners", optimizer)):
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            if args.device == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    shapes = [tuple(p.shape) for p in hidden_matrices(model)]
    numels = [r * c for r, c in shapes]
    owners = assign_owners([newton_schulz_flops(s, 5) for s in shapes], n)
    # per rank (rank 0's figure): all-gather receives the others' shares of every matrix; the owners' exchange
    # receives the others' rows of the matrices it owns, then its rows of the others' results
    gather = sum(x * (n - 1) // n for x in numels) * 4
    owned = sum(x * (n - 1) // n for x, o in zip(numels, owners) if o == rank) * 4
    others = sum(x // n for x, o in zip(numels, owners) if o != rank) * 4
    if rank == 0:
        row = {"procs": n, **{k: statistics.median(v[1:] or v) for k, v in times.items()}}
        row |= {"bytes_gather": gather, "bytes_owners": owned + others, "matrices": len(shapes)}
        Path(args.out).write_text(json.dumps(row))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", default="1,2,4")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    print("| processes | gather everywhere, s/step | owners, s/step | ratio | MB received per rank: gather | owners |")
    print("|---:|---:|---:|---:|---:|---:|")
    for procs in map(int, args.procs.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "row.json"
            command = [
                sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs}", __file__, "--worker",
                f"--dim={args.dim}", f"--layers={args.layers}", f"--steps={args.steps}", f"--device={args.device}",
                f"--out={out}",
            ]  # fmt: skip
            subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True)
            r = json.loads(out.read_text())
        print(
            f"| {procs} | {r['gather_everywhere']:.3f} | {r['owners']:.3f} | "
            f"{r['owners'] / r['gather_everywhere']:.2f} | {r['bytes_gather'] / 1e6:.1f} | {r['bytes_owners'] / 1e6:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
