"""Per-layer expert load over training: Forge's sigmoid/bias router against torchtitan's MoE layer.

    python benchmarks/moe_balance.py [--steps 500] [--variants forge torchtitan] [--out moe_balance.json]
        [--replay] [--oracle [--oracle-from 200] [--oracle-iters 1000]]
        [-- --section.key=value …]   (overrides of presets/moe_small.toml; default: the issue's CPU shape)

Both variants are the same Forge transformer (embeddings, attention, norms, head), the same initial weights
outside the MoE layers, the same data in the same order (the preset's embedded corpus, Forge's loader), the
same optimizer, schedule, gradient clipping and loop; only each MoE feed-forward differs:

- `forge`: Forge's `MoE` with `model.moe_router = "sigmoid_topk"` and the preset's balancing settings
  (`moe_bias_schedule`, `moe_bias_update`, sequence balance loss), the bias moved by Forge's training hooks
  (engine/train/balancing.py) once per training forward;
- `torchtitan`: torchtitan's `MoE` module (torchtitan.models.common.moe, the layer its deepseek_v3 and qwen3
  families build) with a sigmoid `TokenChoiceTopKRouter` (route_norm = True: chosen scores renormalised,
  as Forge does), the same expert count, top-k, expert width and shared expert, `load_balance_coeff` 1e-3,
  its own parameter initialisation (normal, std 0.02, as its qwen3 family), and its own bias update
  (`register_moe_load_balancing_hook`: once per optimizer step, from the tokens counted since the last one).

`--oracle` (Forge's router only) then asks, batch by batch from `--oracle-from` on, how balanced *any* bias
could have routed that very batch: the best bias in hindsight (`hindsight_bias`), a lower bound for every
causal bias rule (see `oracle_batches`).

Each logged row: per MoE layer, max/mean tokens per expert of the step's micro-batches (the metric Forge logs
as `moe/{layer}/imbalance`), and the training loss. On CPU torchtitan's grouped experts compute in bf16
(its GroupedExperts casts), Forge's in fp32.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.config import load_job_config  # noqa: E402
from engine.data.loader import open_train_data  # noqa: E402
from engine.model import build_model  # noqa: E402
from engine.model.moe import MoE, MoEStats  # noqa: E402
from engine.model.routers import group_limited, proportional_step, tokens_per_expert  # noqa: E402
from engine.train.balancing import attach_router_balancing  # noqa: E402
from engine.train.job import seed_everything  # noqa: E402
from engine.train.optim import build_optimizer  # noqa: E402
from engine.train.schedules import build_scheduler  # noqa: E402

ISSUE_SHAPE = [
    "distributed.ep=1",
    "model.dim=128",
    "model.n_heads=4",
    "model.n_layers=3",
    "model.vocab_size=4096",
    "train.batch_size=4",
    "train.seq_len=128",
    "train.grad_accum_steps=1",
    "train.mixed_precision=fp32",
    "scheduler.warmup_steps=20",
    "train.max_steps=500",
    "eval.enabled=false",
]


class TorchtitanMoE(MoE):
    """torchtitan's MoE layer where a Forge block expects a `MoE`: it returns (output, stats) with the load of
    the forward (from its router's choices) and no auxiliary loss. Only `forward` and `router` are used."""

    def __init__(self, cfg, coeff: float) -> None:
        nn.Module.__init__(self)
        from torchtitan.models.common.config_utils import (
            make_ffn_config,
            make_moe_config,
            make_routed_experts_config,
            make_router_config,
        )

        init = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
        out = partial(nn.init.normal_, std=0.02 / math.sqrt(2 * cfg.n_layers))
        experts = {"w1_EFD": init["weight"], "w3_EFD": init["weight"], "w2_EDF": out}
        e, k, width = cfg.num_experts, cfg.moe_top_k, cfg.expert_ffn_dim
        self.num_experts = e
        self.titan = make_moe_config(
            num_experts=e,
            router=make_router_config(
                dim=cfg.dim, num_experts=e, gate_param_init=init, top_k=k, score_func="sigmoid", route_norm=True
            ),
            routed_experts=make_routed_experts_config(
                dim=cfg.dim,
                hidden_dim=width,
                num_experts=e,
                top_k=k,
                param_init=experts,
                comm_backend="standard",
                non_blocking_capacity_factor=None,
            ),
            shared_experts=make_ffn_config(
                dim=cfg.dim,
                hidden_dim=width * cfg.moe_shared_experts,
                w1_param_init=init,
                w2w3_param_init={"weight": out, "bias": nn.init.zeros_},
            ),
            load_balance_coeff=coeff,
        ).build()
        self.titan.init_states()
        self.router = self.titan.router
        self.chosen: list[torch.Tensor] = []
        self.router.register_forward_hook(lambda module, args, outputs: self.chosen.append(outputs[1]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEStats]:
        out = self.titan(x)
        load = tokens_per_expert(self.chosen.pop(), self.num_experts)
        zero = torch.zeros((), device=x.device)
        return out, MoEStats(zero, load, zero, zero, zero, zero)


class NoMesh:
    """The parallel layout torchtitan's balancing hook asks about, for one process: no meshes, no EP or TP."""

    ep_enabled = False
    tp = 1

    def get_optional_mesh(self, name: str) -> None:
        return None


def build(variant: str, cfg) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    seed_everything(cfg.train.seed)
    model = build_model(cfg.model)
    if variant == "torchtitan":
        torch.manual_seed(cfg.train.seed + 1)
        for block in model.layers.values():
            if isinstance(block.feed_forward, MoE):
                block.feed_forward = TorchtitanMoE(cfg.model, coeff=1e-3)
                block.moe_enabled, block.moe = True, block.feed_forward.titan  # what torchtitan's hook walks
    optimizer = build_optimizer(model, cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.scheduler, cfg.train.max_steps)
    if variant == "torchtitan":
        from torchtitan.components.optimizer import register_moe_load_balancing_hook

        register_moe_load_balancing_hook(optimizer, [model], NoMesh())
    else:
        attach_router_balancing(model)
    return model, optimizer, scheduler


def train(
    variant: str, cfg, steps: int, log_every: int, replay: bool = False, oracle: dict | None = None
) -> list[dict]:
    model, optimizer, scheduler = build(variant, cfg)
    batches = open_train_data(cfg).batches()
    model.train()
    rows = []
    for step in range(1, steps + 1):
        loads: dict[str, torch.Tensor] = {}
        for _ in range(cfg.train.grad_accum_steps):
            inputs, labels = next(batches)
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            aux = model.moe_loss()
            ((loss + aux if aux is not None else loss) / cfg.train.grad_accum_steps).backward()
            for name, stats in model.last_moe_stats.items():
                loads[name] = loads.get(name, 0) + stats.load
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip_norm)
        optimizer.step()  # torchtitan's bias update runs here, before the step (a step pre-hook)
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if step % log_every == 0 or step == 1:
            row = {"step": step, "loss": loss.item()}
            row.update({f"{name}": (load.max() / load.mean()).item() for name, load in loads.items()})
            rows.append(row)
            print(variant, json.dumps(row), flush=True)
    if replay:
        rows += replay_batches(model, cfg, steps, variant)
    if oracle is not None:
        rows += oracle_batches(model, cfg, steps, **oracle)
    return rows


@torch.no_grad()
def replay_batches(model: nn.Module, cfg, steps: int, variant: str) -> list[dict]:
    """The trained model, frozen (its balancing bias as training left it), routes every batch of the run again:
    the per-layer max/mean of a router that no longer moves, on the same batches. Where a batch's tokens crowd
    an expert of this frozen router too, the spike in training came from the batch's content, not from the
    bias lagging behind."""
    batches = open_train_data(cfg).batches()
    rows = []
    for step in range(1, steps + 1):
        loads: dict[str, torch.Tensor] = {}
        for _ in range(cfg.train.grad_accum_steps):
            inputs, _ = next(batches)
            model(inputs)  # no gradient: the balancing hooks neither record nor apply
            for name, stats in model.last_moe_stats.items():
                loads[name] = loads.get(name, 0) + stats.load
        row = {"replay_step": step}
        row.update({f"{name}": (load.max() / load.mean()).item() for name, load in loads.items()})
        rows.append(row)
        print(variant, "replay", json.dumps(row), flush=True)
    return rows


def oracle_rates(iters: int, first: float = 0.01, last: float = 1e-5) -> torch.Tensor:
    """The search's rates: geometric from the preset's rate (0.01) down to 1e-5, far below the gaps between the
    scores of distinct tokens, so that the last iterations fine-tune the order of near ties."""
    return torch.logspace(math.log10(first), math.log10(last), iters)


def choose(router: nn.Module, scores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The experts `router` (sigmoid_topk) picks for `scores` [tokens, E] with `bias`: its own selection."""
    return group_limited(scores + bias, router.n_group, router.topk_group).topk(router.top_k, dim=-1).indices


def hindsight_bias(router: nn.Module, x: torch.Tensor, rates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The most balancing bias for this very batch `x` [tokens, dim] that the search finds, and its tokens per
    expert: starting from the trained bias, the preset's proportional update, applied again and again to the
    batch's own load at a decaying rate, keeping the bias with the lowest largest load seen.

    Why this search: a bias routes each token to its top-k of score + bias, and finding the most balanced
    such routing is the dual of the capacitated assignment problem (each token k experts, each expert at most
    tokens·k/E); the bias plays the dual prices and the balancing update, (mean − load)/mean, is a subgradient
    step on that dual. With a decaying rate the iterates approach the dual optimum, whose top-k routing is
    balanced except for the tokens tied at it. So the result is an upper bound on the best bias's max/mean
    (a bias that reaches it exists: this one) and, for scores without exact ties, close to it."""
    scores = F.linear(x.float(), router.gate.weight.float()).sigmoid()
    bias, num_experts = router.bias.clone(), router.bias.numel()
    best, best_load = bias.clone(), None
    for rate in rates:
        load = tokens_per_expert(choose(router, scores, bias), num_experts)
        if best_load is None or load.max() < best_load.max():
            best, best_load = bias.clone(), load
        bias += rate * proportional_step(load)
    return best, best_load


def routed(model: nn.Module, inputs: torch.Tensor, biases: dict[str, torch.Tensor] | None = None) -> dict:
    """Each MoE layer's chosen experts [tokens, k] for `inputs`, every router using `biases[layer]` if given
    (layer by layer: each layer's input is what the earlier layers computed with theirs)."""
    routers, experts = model.moe_routers(), {}
    trained = {name: router.bias.clone() for name, router in routers.items()}
    handles = [
        router.register_forward_hook(lambda module, args, out, name=name: experts.__setitem__(name, out.experts))
        for name, router in routers.items()
    ]
    try:
        for name, bias in (biases or {}).items():
            routers[name].bias.copy_(bias)
        model(inputs)
    finally:
        for handle in handles:
            handle.remove()
        for name, bias in trained.items():
            routers[name].bias.copy_(bias)
    return experts


def oracle_routing(model: nn.Module, inputs: torch.Tensor, rates: torch.Tensor) -> tuple[dict, dict]:
    """Route `inputs` with, at each MoE layer, the hindsight bias for the tokens that reach it: a forward
    pre-hook on each router searches the bias (`hindsight_bias`) and sets it just before the router runs, so
    later layers see the outputs of the layers routed by the oracle, as a model running with those biases
    would. Returns (the biases, the chosen experts) per layer; the trained biases are restored."""
    routers, biases = model.moe_routers(), {}

    def search(router: nn.Module, args: tuple, name: str) -> None:
        biases[name] = hindsight_bias(router, args[0], rates)[0]
        router.bias.copy_(biases[name])

    trained = {name: router.bias.clone() for name, router in routers.items()}
    handles = [router.register_forward_pre_hook(partial(search, name=name)) for name, router in routers.items()]
    try:
        experts = routed(model, inputs, trained)  # `routed` restores each bias the hooks set
    finally:
        for handle in handles:
            handle.remove()
    return biases, experts


def content(inputs: torch.Tensor, experts: torch.Tensor, num_experts: int) -> dict:
    """What the batch's text looks like to one layer: the most frequent token id of the batch and its share,
    and for the layer's most loaded expert its load and how many of its tokens are one token id (which one)."""
    ids = inputs.flatten()
    counts = torch.bincount(ids)
    top = int(experts.flatten().bincount(minlength=num_experts).argmax())
    mine = ids[(experts == top).any(dim=-1)]
    mine_counts = torch.bincount(mine)
    return {
        "top_id": int(counts.argmax()),
        "top_id_share": counts.max().item() / ids.numel(),
        "expert": top,
        "expert_load": mine.numel(),
        "expert_top_id": int(mine_counts.argmax()),
        "expert_top_id_tokens": int(mine_counts.max()),
    }


@torch.no_grad()
def oracle_batches(model: nn.Module, cfg, steps: int, start: int, iters: int) -> list[dict]:
    """Every batch of the run from step `start` on, routed by the trained model, frozen, three ways, with each
    MoE layer's max/mean tokens per expert:

    - `frozen`: the trained bias (as `--replay`);
    - `oracle`: each layer's hindsight bias for this very batch (`oracle_routing`). It sees the batch it
      routes, so no causal rule can balance it better: where even it stays above a target, no bias does;
    - `oracle_shift`: per layer, the largest change of one expert's bias from the trained one to the oracle's;
    - `lag1`: the oracle biases of the previous batch, the best a rule that fits each batch exactly could
      apply to the next one (how much of the oracle's balance carries over from one batch to the next).

    Plus `content`: per layer, the batch's most frequent token and the share of the most loaded expert's
    tokens that are one token id (under the trained bias)."""
    if cfg.train.grad_accum_steps != 1:
        raise SystemExit("--oracle routes one micro-batch per step: run it with train.grad_accum_steps=1")
    rates, batches = oracle_rates(iters), open_train_data(cfg).batches()
    layers, routers, previous, rows = model.moe_layers(), model.moe_routers(), None, []

    def max_mean(experts: dict) -> dict:
        loads = {name: tokens_per_expert(chosen, layers[name].num_experts) for name, chosen in experts.items()}
        return {name: (load.max() / load.mean()).item() for name, load in loads.items()}

    for step in range(1, steps + 1):
        inputs, _ = next(batches)
        if step < start:
            continue
        frozen = routed(model, inputs)
        biases, oracle = oracle_routing(model, inputs, rates)
        row = {"oracle_step": step, "frozen": max_mean(frozen), "oracle": max_mean(oracle)}
        row["oracle_shift"] = {name: (bias - routers[name].bias).abs().max().item() for name, bias in biases.items()}
        if previous is not None:
            row["lag1"] = max_mean(routed(model, inputs, previous))
        row["content"] = {name: content(inputs, chosen, layers[name].num_experts) for name, chosen in frozen.items()}
        previous = biases
        rows.append(row)
        print("forge oracle", json.dumps(row), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--variants", nargs="+", choices=["forge", "torchtitan"], default=["forge", "torchtitan"])
    p.add_argument("--preset", default=str(REPO / "presets" / "moe_small.toml"))
    p.add_argument("--out")
    p.add_argument("--replay", action="store_true", help="then route every batch again with the trained model frozen")
    p.add_argument("--oracle", action="store_true", help="then each batch's best bias in hindsight (forge only)")
    p.add_argument("--oracle-from", type=int, default=200, help="the first step whose batch the oracle routes")
    p.add_argument("--oracle-iters", type=int, default=1000, help="bias updates the oracle's search makes per layer")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides after the issue's shape")
    args = p.parse_args()
    if args.oracle and args.variants != ["forge"]:
        p.error("--oracle searches the bias of Forge's sigmoid_topk router: run it with --variants forge")
    oracle = {"start": args.oracle_from, "iters": args.oracle_iters} if args.oracle else None
    cfg = load_job_config(Path(args.preset), [*ISSUE_SHAPE, *args.overrides])
    import torchtitan

    report = {
        "setup": {"preset": args.preset, "overrides": [*ISSUE_SHAPE, *args.overrides], "steps": args.steps},
        "torch": torch.__version__,
        "torchtitan": getattr(torchtitan, "__version__", "?"),
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "runs": {
            variant: train(variant, cfg, args.steps, args.log_every, args.replay, oracle) for variant in args.variants
        },
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
