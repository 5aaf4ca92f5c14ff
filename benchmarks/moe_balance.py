"""Per-layer expert load over training: Forge's sigmoid/bias router against torchtitan's MoE layer.

    python benchmarks/moe_balance.py [--steps 500] [--variants forge torchtitan] [--out moe_balance.json]
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
from engine.model.routers import tokens_per_expert  # noqa: E402
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


def train(variant: str, cfg, steps: int, log_every: int, replay: bool = False) -> list[dict]:
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--variants", nargs="+", choices=["forge", "torchtitan"], default=["forge", "torchtitan"])
    p.add_argument("--preset", default=str(REPO / "presets" / "moe_small.toml"))
    p.add_argument("--out")
    p.add_argument("--replay", action="store_true", help="then route every batch again with the trained model frozen")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides after the issue's shape")
    args = p.parse_args()
    cfg = load_job_config(Path(args.preset), [*ISSUE_SHAPE, *args.overrides])
    import torchtitan

    report = {
        "setup": {"preset": args.preset, "overrides": [*ISSUE_SHAPE, *args.overrides], "steps": args.steps},
        "torch": torch.__version__,
        "torchtitan": getattr(torchtitan, "__version__", "?"),
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "runs": {variant: train(variant, cfg, args.steps, args.log_every, args.replay) for variant in args.variants},
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
