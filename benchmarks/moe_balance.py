"""Per-layer expert load over training: Forge's sigmoid/bias router against torchtitan's MoE layer.

    python benchmarks/moe_balance.py [--steps 500] [--variants forge torchtitan] [--out moe_balance.json]
        [--replay] [--oracle [--oracle-from 200] [--oracle-iters 1000]]
        [--minimax] [--online RULE:RATE …] [--rolling PAST EVERY]
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
causal bias rule (see `oracle_batches`). `--minimax` asks the same of one bias held for many batches: the
bias with the lowest worst batch that a search finds, chosen in hindsight on every other step's batch from
`--oracle-from` on, and how it routes the batches in between that it was not chosen on (`minimax_batches`).
`--online` replays those batches through the frozen model with a causal rule moving the bias from the trained
one (`online_batches`); `--rolling PAST EVERY` refits that search's bias every EVERY steps on the PAST batches
before and routes the next EVERY with it (`rolling_batches`). All of them route with the model as training
left it: only the bias is chosen causally or in hindsight, not the model.

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
from engine.model.routers import group_limited, proportional_step, sign_step, tokens_per_expert  # noqa: E402
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


def train(variant: str, cfg, steps: int, log_every: int, args: argparse.Namespace) -> dict:
    """Train `variant` for `steps` steps, logging every `log_every`-th; then the analyses `args` asks for, on the
    trained model. Returns {"rows": logged rows (replay and oracle rows after them), analysis: report}."""
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
    if args.replay:
        rows += replay_batches(model, cfg, steps, variant)
    if args.oracle:
        rows += oracle_batches(model, cfg, steps, args.oracle_from, args.oracle_iters)
    run = {"rows": rows}
    if args.minimax:
        run["minimax"] = minimax_batches(model, cfg, steps, args.oracle_from, args.oracle_iters)
    if args.online:
        run["online"] = online_batches(model, cfg, steps, args.oracle_from, args.online)
    if args.rolling:
        past, every = args.rolling
        run["rolling"] = rolling_batches(model, cfg, steps, args.oracle_from, args.oracle_iters, past, every)
    return run


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
    rates = oracle_rates(iters)
    layers, routers, previous, rows = model.moe_layers(), model.moe_routers(), None, []

    def max_mean(experts: dict) -> dict:
        loads = {name: tokens_per_expert(chosen, layers[name].num_experts) for name, chosen in experts.items()}
        return {name: (load.max() / load.mean()).item() for name, load in loads.items()}

    for step, inputs in enumerate(later_batches(cfg, steps, start), start):
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


def batch_loads(experts: torch.Tensor, batches: int, num_experts: int) -> torch.Tensor:
    """[batches, num_experts] tokens per expert of each of `batches` equal, consecutive batches in `experts`
    [batches · tokens, k], by one scatter-add (exact integer counts, as `tokens_per_expert` of each batch)."""
    batch_of = torch.arange(batches, device=experts.device).repeat_interleave(experts.numel() // batches)
    return tokens_per_expert(batch_of * num_experts + experts.flatten(), batches * num_experts).view(batches, -1)


def minimax_bias(router: nn.Module, x: torch.Tensor, batches: int, rates: torch.Tensor) -> torch.Tensor:
    """The bias with the lowest worst batch that the search finds for the tokens `x` [batches · tokens, dim] of
    `batches` equal batches, one bias for all of them: from the trained bias, each iteration applies the
    proportional update to the load of the batch whose largest expert is the most loaded, at a decaying rate,
    keeping the bias whose worst batch was the lowest. `hindsight_bias`'s update rule on the objective max over
    batches of max over experts (a minimax, not the mean load that the training rules balance); a heuristic:
    unlike one batch's assignment problem, this objective has no dual optimum the iterates are known to reach,
    so the result shows what one bias can do (it exists: this one), not the best any bias can."""
    scores = F.linear(x.float(), router.gate.weight.float()).sigmoid()
    bias, num_experts = router.bias.clone(), router.bias.numel()
    best, best_worst = bias.clone(), math.inf
    for rate in rates:
        loads = batch_loads(choose(router, scores, bias), batches, num_experts)
        ratios = loads.max(dim=-1).values / loads.mean(dim=-1)
        if ratios.max().item() < best_worst:
            best, best_worst = bias.clone(), ratios.max().item()
        bias += rate * proportional_step(loads[ratios.argmax()])
    return best


def fitted_minimax(model: nn.Module, batches: list[torch.Tensor], iters: int) -> dict[str, torch.Tensor]:
    """Per MoE layer, `minimax_bias` for `batches`, layer by layer through forward pre-hooks (each layer
    searched on what the earlier layers computed with theirs); the trained biases are restored."""
    routers, biases = model.moe_routers(), {}

    def search(router: nn.Module, args: tuple, name: str) -> None:
        biases[name] = minimax_bias(router, args[0], len(batches), oracle_rates(iters))
        router.bias.copy_(biases[name])

    trained = {name: router.bias.clone() for name, router in routers.items()}
    handles = [router.register_forward_pre_hook(partial(search, name=name)) for name, router in routers.items()]
    try:
        routed(model, torch.cat(batches), trained)  # `routed` restores the trained biases the hooks replaced
    finally:
        for handle in handles:
            handle.remove()
    return biases


def worst_layers(model: nn.Module, batches: list[torch.Tensor], biases: dict | None = None) -> list[float]:
    """Per batch, the worst MoE layer's max/mean tokens per expert, the batches routed in one forward (rows are
    independent: attention stays within a row) with `biases` per layer if given (else the trained ones)."""
    experts, layers = routed(model, torch.cat(batches), biases), model.moe_layers()
    per_layer = []
    for name, chosen in experts.items():
        loads = batch_loads(chosen, len(batches), layers[name].num_experts)
        per_layer.append(loads.max(dim=-1).values / loads.mean(dim=-1))
    return torch.stack(per_layer).max(dim=0).values.tolist()


def later_batches(cfg, steps: int, start: int) -> list[torch.Tensor]:
    """The input batches of steps `start`..`steps`, in order (one micro-batch per step)."""
    if cfg.train.grad_accum_steps != 1:
        raise SystemExit(
            "--oracle, --minimax and --online route one micro-batch per step: use train.grad_accum_steps=1"
        )
    batches = open_train_data(cfg).batches()
    return [inputs for step, (inputs, _) in zip(range(1, steps + 1), batches) if step >= start]


def summary(ratios: list[float], limit: float = 2.2) -> dict:
    ordered = sorted(ratios)
    return {
        "batches": len(ordered),
        "worst": ordered[-1],
        "above_2.2": sum(r > limit for r in ordered),
        "median": ordered[len(ordered) // 2],
    }


@torch.no_grad()
def minimax_batches(model: nn.Module, cfg, steps: int, start: int, iters: int) -> dict:
    """The trained model, frozen, on the batches of steps `start`..`steps`: one bias per layer chosen on the
    batches of steps `start`, `start` + 2, … (`fitted_minimax`), then held fixed for the batches in between,
    against the trained bias on those same batches. Where the held-out batches stay below a target, a bias that does it exists and the
    training rule's bias is not at the floor of what a bias can do; whether a causal rule can find it is
    `rolling_batches`'s question."""
    batches = later_batches(cfg, steps, start)
    fit, held_out = batches[0::2], batches[1::2]
    biases = fitted_minimax(model, fit, iters)
    trained = {name: router.bias for name, router in model.moe_routers().items()}
    report = {
        "fit": f"the batches of steps {start}, {start + 2}, … up to {steps}; held out: those in between",
        "trained_bias_on_held_out": summary(worst_layers(model, held_out)),
        "minimax_bias_on_fit": summary(worst_layers(model, fit, biases)),
        "minimax_bias_on_held_out": summary(worst_layers(model, held_out, biases)),
        "largest_shift_from_trained": {
            name: (bias - trained[name]).abs().max().item() for name, bias in biases.items()
        },
    }
    print("forge minimax", json.dumps(report), flush=True)
    return report


@torch.no_grad()
def rolling_batches(model: nn.Module, cfg, steps: int, start: int, iters: int, past: int, every: int) -> dict:
    """A causal use of `minimax_bias` on the frozen model: every `every` steps from `start` on, the bias is fitted
    on the batches of the `past` steps before and routes the next `every` batches. The model does not drift
    here, so what stays above a target comes from batches unlike those the bias was fitted on."""
    batches = later_batches(cfg, steps, start - past)
    ratios = []
    for first in range(past, len(batches), every):
        biases = fitted_minimax(model, batches[first - past : first], iters)
        ratios += worst_layers(model, batches[first : first + every], biases)
    report = {"past": past, "every": every, **summary(ratios)}
    print("forge rolling", json.dumps(report), flush=True)
    return report


def power_step(power: float):
    """A bias step that balances the mean of (load / mean load)^power instead of the mean load: with power > 1
    an expert whose load swings high is pushed below the mean more than one whose load is steady."""

    def step(load: torch.Tensor) -> torch.Tensor:
        ratio = (load / load.mean().clamp(min=1e-9)).pow(power)
        return (ratio.mean() - ratio) / ratio.mean().clamp(min=1e-9)

    return step


ONLINE_RULES = {"sign": sign_step, "proportional": proportional_step, "power2": power_step(2), "power3": power_step(3)}


@torch.no_grad()
def online_batches(model: nn.Module, cfg, steps: int, start: int, rules: list[str]) -> dict:
    """The trained model, frozen, routes the batches of steps `start`..`steps` in order while a causal rule moves
    each layer's bias after every batch from that batch's load, starting from the trained bias (`rule:rate`,
    rate 0 = the trained bias held). The model does not drift here, so what stays above a target is the rule's
    reaction to the batches alone."""
    batches, routers, report = later_batches(cfg, steps, start), model.moe_routers(), {}
    trained = {name: router.bias.clone() for name, router in routers.items()}
    for spec in rules:
        name, rate = spec.split(":")
        step_of, ratios = ONLINE_RULES[name], []
        for inputs in batches:
            model(inputs)
            loads = {layer: stats.load for layer, stats in model.last_moe_stats.items()}
            ratios.append(max((load.max() / load.mean()).item() for load in loads.values()))
            for layer, load in loads.items():
                routers[layer].bias.add_(float(rate) * step_of(load))
        for layer, bias in trained.items():
            routers[layer].bias.copy_(bias)
        report[spec] = summary(ratios)
        print("forge online", spec, json.dumps(report[spec]), flush=True)
    return report


def online_rule(spec: str) -> bool:
    """Whether `spec` is a RULE:RATE that `online_batches` runs: a known rule and a rate >= 0."""
    name, _, rate = spec.partition(":")
    try:
        return name in ONLINE_RULES and float(rate) >= 0
    except ValueError:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--variants", nargs="+", choices=["forge", "torchtitan"], default=["forge", "torchtitan"])
    p.add_argument("--preset", default=str(REPO / "presets" / "moe_small.toml"))
    p.add_argument("--out")
    p.add_argument("--replay", action="store_true", help="then route every batch again with the trained model frozen")
    p.add_argument("--oracle", action="store_true", help="then each batch's best bias in hindsight (forge only)")
    p.add_argument("--minimax", action="store_true", help="then one bias for many batches in hindsight (forge only)")
    p.add_argument(
        "--online",
        nargs="+",
        metavar="RULE:RATE",
        help=f"then causal rules on the frozen model: {', '.join(ONLINE_RULES)}",
    )
    p.add_argument(
        "--rolling", nargs=2, type=int, metavar=("PAST", "EVERY"), help="then a causal minimax refit (forge only)"
    )
    p.add_argument("--oracle-from", type=int, default=200, help="the first step whose batch the analyses route")
    p.add_argument("--oracle-iters", type=int, default=1000, help="bias updates each search makes per layer")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides after the issue's shape")
    args = p.parse_args()
    if (args.oracle or args.minimax or args.online or args.rolling) and args.variants != ["forge"]:
        p.error(
            "--oracle, --minimax, --online and --rolling move the bias of Forge's sigmoid_topk router: use --variants forge"
        )
    unknown = [spec for spec in args.online or [] if not online_rule(spec)]
    if unknown:
        p.error(f"--online takes RULE:RATE, RULE one of {', '.join(ONLINE_RULES)}, RATE >= 0; got {', '.join(unknown)}")
    if args.rolling and not (0 < args.rolling[0] < args.oracle_from and args.rolling[1] > 0):
        p.error(f"--rolling PAST EVERY needs 0 < PAST < --oracle-from ({args.oracle_from}) and EVERY > 0")
    cfg = load_job_config(Path(args.preset), [*ISSUE_SHAPE, *args.overrides])
    import torchtitan

    report = {
        "setup": {"preset": args.preset, "overrides": [*ISSUE_SHAPE, *args.overrides], "steps": args.steps},
        "torch": torch.__version__,
        "torchtitan": getattr(torchtitan, "__version__", "?"),
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "runs": {variant: train(variant, cfg, args.steps, args.log_every, args) for variant in args.variants},
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
