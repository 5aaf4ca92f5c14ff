"""Same-process A/B of how the MoE layer counts tokens per expert: the fixed-size scatter-add Forge uses
(no host synchronisation) against `torch.bincount` (what it used before, whose output size is read on the host).

    python benchmarks/bench_moe_counts.py [--experts 8 64] [--tokens 4096] [--rounds 7] [--steps 3]

One MoE feed-forward (bench_moe.py's: softmax top-2, grouped experts), forward + backward, the same module,
weights and batch; the two counting functions are swapped in on alternating rounds, so machine load hits
both alike. Medians over rounds × steps.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_args import emit
from bench_moe import timed

import engine.model.moe as moe_module
from engine.config.model import ModelConfig
from engine.model.moe import MoE
from engine.model.routers import expert_counts


def bincount_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    return torch.bincount(experts.flatten(), minlength=num_experts)


COUNTERS = {"scatter_add": expert_counts, "bincount": bincount_counts}


def use(counter) -> None:
    """Route both of the layer's counts (tokens_per_expert, sort_by_expert) through `counter`."""
    moe_module.expert_counts = counter
    moe_module.tokens_per_expert = lambda experts, n: counter(experts, n).float()


def bench(args: argparse.Namespace, experts: int) -> dict:
    cfg = ModelConfig(dim=256, n_heads=1, num_experts=experts, moe_top_k=2, ffn_hidden_dim=256)
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, args.tokens, 256, requires_grad=True)
    times: dict[str, list[float]] = {name: [] for name in COUNTERS}
    for counter in COUNTERS.values():  # warm-up
        use(counter)
        timed(moe, x, 2)
    for _ in range(args.rounds):
        for name, counter in COUNTERS.items():
            use(counter)
            times[name] += timed(moe, x, args.steps)
    use(expert_counts)
    result: dict = {"experts": experts}
    for name, samples in times.items():
        median = statistics.median(samples)
        result[name] = {"step_ms": round(1000 * median, 2), "tokens_per_sec": round(args.tokens / median)}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    report = {"setup": vars(args), "torch": torch.__version__, "threads": torch.get_num_threads()}
    report["results"] = [bench(args, e) for e in args.experts]
    emit(report, args.out)


if __name__ == "__main__":
    main()
