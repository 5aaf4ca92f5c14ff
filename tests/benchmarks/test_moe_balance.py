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


def test_fitted_biases_leave_the_model_as_trained_and_worst_layers_recounts_each_batch():
    """`fitted_minimax` and `worst_layers` (what `--minimax` and `--rolling` report) on a tiny model: they leave
    every router's bias and hooks as they found them, and the worst layer `worst_layers` reports for each of
    the batches routed together equals a recount of that batch's block of tokens in the same routing."""
    from tests.helpers.moe import tiny_moe

    model = tiny_moe("sigmoid_topk").eval()
    routers = model.moe_routers()
    with torch.no_grad():
        for router in routers.values():
            router.bias.normal_(std=0.05)
    trained = {name: router.bias.clone() for name, router in routers.items()}
    torch.manual_seed(1)
    batches = [torch.randint(0, 97, (2, 16)) for _ in range(4)]
    module = bench()
    with torch.no_grad():
        biases = module.fitted_minimax(model, batches, 50)
        reported = module.worst_layers(model, batches, biases)
        experts = module.routed(model, torch.cat(batches), biases)
    assert sorted(biases) == sorted(trained) and all(not torch.equal(biases[n], trained[n]) for n in trained)
    assert all(torch.equal(router.bias, trained[name]) for name, router in routers.items())
    assert all(not router._forward_pre_hooks and not router._forward_hooks for router in routers.values())
    assert len(experts) == 3 and all(chosen.shape == (4 * 32, 2) for chosen in experts.values())
    recount = [
        max(
            float(load.max() / load.mean())
            for load in (tokens_per_expert(e[32 * b : 32 * (b + 1)], 16) for e in experts.values())
        )
        for b in range(4)
    ]
    assert len(reported) == 4 and reported == recount
