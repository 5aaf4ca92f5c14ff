"""The searches of benchmarks/moe_balance.py that the balancing results rest on (results in
benchmarks/results/moe_balance.md), at toy size: per-batch loads by one scatter-add, and the minimax bias
(one bias for many batches) against a recount with the router itself."""

from __future__ import annotations

import importlib.util

import torch

from engine.config.model import ModelConfig
from engine.model.routers import SigmoidTopK, tokens_per_expert
from tests.conftest import REPO


def bench():
    spec = importlib.util.spec_from_file_location("moe_balance", REPO / "benchmarks" / "moe_balance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_batch_loads_equal_each_batch_counted_alone():
    torch.manual_seed(0)
    experts = torch.randint(0, 16, (5 * 40, 3))
    loads = bench().batch_loads(experts, 5, 16)
    assert loads.shape == (5, 16)
    for batch, chosen in enumerate(experts.view(5, 40, 3)):
        assert torch.equal(loads[batch], tokens_per_expert(chosen, 16))
    assert loads.sum().item() == experts.numel()


def test_minimax_bias_balances_every_batch_of_a_skewed_router():
    """Scores sharing a large per-expert offset (most tokens agree on the same experts): with no bias the worst
    of 6 batches is far from balanced (6.7 × the mean load here); the one bias the search returns, set on the
    router, routes every batch (counted by the router's own forward) below twice the mean load (1.44 here)."""
    torch.manual_seed(0)
    cfg = ModelConfig(dim=16, n_heads=1, num_experts=16, moe_top_k=2, moe_router="sigmoid_topk")
    router = SigmoidTopK(cfg)
    with torch.no_grad():
        router.gate.weight.normal_(std=0.1)
    tokens = torch.randn(6 * 128, 16) * 0.5 + torch.randn(16)

    def worst() -> float:
        with torch.no_grad():
            loads = [tokens_per_expert(router(batch).experts, 16) for batch in tokens.view(6, 128, 16)]
        assert len(loads) == 6
        return max(float(load.max() / load.mean()) for load in loads)

    before = worst()
    module = bench()
    with torch.no_grad():
        bias = module.minimax_bias(router, tokens, 6, module.oracle_rates(300))
    assert torch.equal(router.bias, torch.zeros(16))  # the search leaves the router's own bias alone
    router.bias.copy_(bias)
    after = worst()
    assert before > 4 and after < 2, (before, after)
