"""Per-layer expert load metrics against a recount by hand from the routing decisions, and the MoE forward
at ep = 1 without host synchronisation."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine.config.model import ModelConfig
from engine.model.routing_metrics import moe_metrics
from engine.model.transformer import Transformer
from engine.train.balancing import attach_router_balancing
from engine.train.moe_load import ExpertLoadWindow
from tests.helpers.moe import HOST_READS, CountSyncs, tiny_moe


def capture_routing(model: Transformer) -> dict[str, list[torch.Tensor]]:
    """Layer name → the chosen experts [tokens, k] of every forward, taken from each router's output."""
    chosen: dict[str, list[torch.Tensor]] = {name: [] for name in model.moe_routers()}
    for name, router in model.moe_routers().items():
        router.register_forward_hook(lambda module, args, out, name=name: chosen[name].append(out.experts.clone()))
    return chosen


@pytest.mark.parametrize("router", ["sigmoid_topk", "softmax_topk"])
def test_per_layer_load_metrics_equal_a_recount_of_the_routing_decisions(router):
    """Two training micro-batches: imbalance and load_cv from the last one's decisions, dead experts from both
    (an expert is dead only if neither picked it), totals over the layers (the worst layer named)."""
    fields = {"moe_bias_schedule": [[0, 0.05]]} if router == "sigmoid_topk" else {}
    model = tiny_moe(router, **fields)
    chosen = capture_routing(model)
    window = ExpertLoadWindow()
    window.attach(model)
    attach_router_balancing(model)
    model.train()
    # few tokens per micro-batch (6 tokens · top-2 = 12 assignments over 16 experts): dead experts certain
    for seed in (1, 2):
        tokens = torch.randint(0, 97, (2, 3), generator=torch.Generator().manual_seed(seed))
        model(tokens).sum().backward()
    metrics = moe_metrics(model, window.take())
    assert set(chosen) == {"0", "1", "2"} and all(len(forwards) == 2 for forwards in chosen.values())
    worst, dead_total = None, 0
    for name, forwards in chosen.items():
        last = Counter(forwards[-1].flatten().tolist())
        counts = [last.get(e, 0) for e in range(16)]
        mean = sum(counts) / 16  # = 6 tokens · 2 / 16
        std = math.sqrt(sum((c - mean) ** 2 for c in counts) / 16)
        used = set(torch.cat(forwards).flatten().tolist())
        dead = 16 - len(used)
        # the metrics are fp32 ratios of small integers: exact to fp32 rounding (a few ulps of values ≤ 16)
        assert metrics[f"moe/{name}/imbalance"] == pytest.approx(max(counts) / mean, rel=1e-6)
        assert metrics[f"moe/{name}/load_cv"] == pytest.approx(std / mean, rel=1e-6)
        assert metrics[f"moe/{name}/dead_experts"] == dead
        assert dead >= 16 - 2 * 12  # proves nothing by itself; the equality above is the check
        dead_total += dead
        if worst is None or max(counts) / mean > metrics[f"moe/{worst}/imbalance"]:
            worst = name
    assert dead_total > 0  # 24 assignments over 16 experts per layer, some layers certainly skip experts
    assert metrics["moe/imbalance_layer"] == int(worst)
    assert metrics["moe/imbalance"] == metrics[f"moe/{worst}/imbalance"]
    assert metrics["moe/dead_experts"] == dead_total
    assert metrics["moe/load_cv"] == max(metrics[f"moe/{n}/load_cv"] for n in chosen)
    # the window starts over after it is read, and evaluation forwards do not count
    model.eval()
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long))
    assert window.take() == {}


class CountHostReads(TorchFunctionMode):
    """Counts the Tensor methods that bring a value to the host, which on a GPU wait for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.calls.append(HOST_READS[func])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "router,fields",
    [
        ("sigmoid_topk", {"moe_sequence_aux_loss_weight": 1e-4}),
        ("softmax_topk", {"moe_aux_loss_weight": 0.01, "moe_router_z_loss_weight": 1e-3}),
        ("softmax_topk", {"moe_capacity_factor": 1.0, "moe_gradient_scale": True}),
    ],
)
@pytest.mark.parametrize("implementation", ["grouped", "loop"])
def test_the_moe_forward_at_ep1_makes_no_host_synchronisation(router, fields, implementation):
    """A training forward of every MoE block (router, losses, sort by expert, experts, combine) and the bias
    update before it, under a dispatch mode that counts the ops that synchronise; `loop` is the fallback
    where grouped_mm is missing, whose split sizes need the counts on the host (one sync per layer)."""
    from engine.model.moe import GROUPED_MM

    if implementation == "grouped" and GROUPED_MM is None:
        pytest.skip("this torch has no grouped_mm")
    model = tiny_moe(router, **fields)
    for moe in model.moe_layers().values():
        moe.implementation = implementation
    attach_router_balancing(model)
    model.train()
    tokens = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens).sum().backward()  # the first forward records a load; the next applies it
    syncs, reads = CountSyncs(), CountHostReads()
    with reads, syncs:
        out = model(tokens)
    assert out.shape == (2, 8, 97) and len(model.last_moe_stats) == 3
    assert syncs.calls == []
    assert reads.calls == ([] if implementation == "grouped" else ["tolist"] * 3)  # the loop's split sizes


def fake_moe_run(run_dir, imbalances: list[list[float]]) -> None:
    """A run directory as training leaves it, with per-layer expert load in its metrics (no training)."""
    import json

    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text("[train]\nmax_steps = 20\n")
    rows = []
    for i, layers in enumerate(imbalances):
        row = {"step": 10 * (i + 1), "loss": 5.0 - i, "tokens_seen": 100 * (i + 1)}
        row.update({f"moe/{layer}/imbalance": value for layer, value in enumerate(layers)})
        worst = max(range(len(layers)), key=layers.__getitem__)
        row.update({"moe/imbalance": layers[worst], "moe/imbalance_layer": worst})
        rows.append(json.dumps(row))
    (run_dir / "metrics.jsonl").write_text("\n".join(rows) + "\n")


def test_forge_runs_names_the_worst_layer_and_compare_plots_each_layers_load(tmp_path, monkeypatch):
    from matplotlib.figure import Figure
    from typer.testing import CliRunner

    from forgecli.app import app

    fake_moe_run(tmp_path / "runs" / "a", [[1.5, 9.0, 4.0], [1.2, 1.8, 2.6]])
    fake_moe_run(tmp_path / "runs" / "b", [[3.0, 2.0], [1.1, 1.3]])
    env = {"NO_COLOR": "1", "COLUMNS": "250"}
    listed = CliRunner().invoke(app, ["runs", str(tmp_path / "runs")], env=env)
    assert listed.exit_code == 0, listed.output
    assert "expert load" in listed.output and "2.60 (layer 2)" in listed.output and "1.30 (layer 1)" in listed.output
    assert "max/mean tokens per expert" in listed.output and "1 = balanced" in listed.output  # the caption
    saved: list[Figure] = []
    savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (saved.append(self), savefig(self, *a, **k))[1])
    runs = [str(tmp_path / "runs" / name) for name in ("a", "b")]
    compared = CliRunner().invoke(app, ["runs", "compare", *runs, "--plot", str(tmp_path / "c.png")], env=env)
    assert compared.exit_code == 0, compared.output
    assert len(saved) == 1
    panel = next(axes for axes in saved[0].axes if axes.get_title().startswith("expert load per layer"))
    lines = {line.get_label(): line for line in panel.get_lines() if not line.get_label().startswith("_")}
    assert sorted(lines) == ["a layer 0", "a layer 1", "a layer 2", "b layer 0", "b layer 1"]
    assert list(lines["a layer 1"].get_ydata()) == [9.0, 1.8] and list(lines["a layer 1"].get_xdata()) == [10, 20]
    assert list(lines["b layer 0"].get_ydata()) == [3.0, 1.1]


def routed_imbalance_after(updates: int, schedule, rule: str) -> float:
    """A sigmoid router whose scores share a large per-expert offset (most tokens agree on the same few
    experts, as in early training) balancing itself for `updates` forwards on a fixed batch; → the max/mean
    tokens per expert of the last one. No training, no randomness after the seed: deterministic."""
    from engine.model.routers import SigmoidTopK, tokens_per_expert

    torch.manual_seed(0)
    cfg = ModelConfig(
        dim=16,
        n_heads=1,
        num_experts=16,
        moe_top_k=2,
        moe_router="sigmoid_topk",
        moe_bias_schedule=schedule,
        moe_bias_update=rule,
    )
    router = SigmoidTopK(cfg)
    with torch.no_grad():
        router.gate.weight.normal_(std=0.1)
    tokens = torch.randn(256, 16) * 0.5 + torch.randn(16)  # a direction common to all tokens
    for _ in range(updates):
        router.apply_bias_update()
        load = tokens_per_expert(router(tokens).experts, 16)
        router.record_load(load)
    return float(load.max() / load.mean())


def test_the_presets_balancing_evens_out_a_skewed_router_faster_than_the_old_rule():
    """moe_small's bias settings against the old ones (sign, rate 0.001) on the same skewed router: 20
    updates leave the old rule where it started (it moves every bias by 0.02 at most, less than the scores'
    spread) while the preset's balance it; both start from the same routing (update 0 changes nothing)."""
    from engine.config import load_job_config
    from tests.conftest import REPO

    model = load_job_config(REPO / "presets" / "moe_small.toml").model
    assert routed_imbalance_after(1, model.moe_bias_schedule, model.moe_bias_update) == pytest.approx(
        start := routed_imbalance_after(1, [[0, 0.001]], "sign")
    )
    assert start > 7  # the skew is real: most tokens share their top-2 (8 = all of them)
    old = routed_imbalance_after(20, [[0, 0.001]], "sign")
    new = routed_imbalance_after(20, model.moe_bias_schedule, model.moe_bias_update)
    assert old > 7 and new < 2, (old, new)
