"""Mixture of experts: grouped experts against the per-expert loop, routers and losses against direct
computations, the balancing bias, config rules, counts, and MoE through the trainer."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.config import load_job_config
from engine.config.model import ModelConfig
from engine.errors import ConfigError
from engine.model.estimate import param_counts, training_flops_per_token
from engine.model.moe import GROUPED_MM, MoE, grouped_experts, looped_experts, within_capacity
from engine.model.routers import (
    SigmoidTopK,
    SoftmaxTopK,
    SoftmaxTopKRenorm,
    balance_loss,
    router_z_loss,
    sequence_balance_loss,
)
from engine.model.routing_metrics import moe_metrics
from engine.model.transformer import Transformer
from engine.parallel.apply import apply_activation_checkpointing
from engine.plan import check_config
from tests.helpers.parity import fp32_bound

REPO = Path(__file__).resolve().parents[2]
needs_grouped_mm = pytest.mark.skipif(GROUPED_MM is None, reason="this torch has no grouped_mm")


def moe_config(**fields) -> ModelConfig:
    base = dict(dim=32, n_layers=2, n_heads=4, vocab_size=97, max_seq_len=32, num_experts=4, moe_top_k=2)
    return ModelConfig(**{**base, **fields})


def expert_weights(experts: int, dim: int, hidden: int) -> list[torch.Tensor]:
    shapes = [(experts, dim, hidden), (experts, dim, hidden), (experts, hidden, dim)]
    return [(torch.randn(shape, dtype=torch.float64) * 0.3).float().requires_grad_() for shape in shapes]


@needs_grouped_mm
@pytest.mark.parametrize("experts,k,empty", [(4, 2, []), (8, 2, [0, 5]), (6, 1, [1, 2, 3]), (3, 3, [])])
def test_grouped_experts_equal_the_loop(experts, k, empty, parity):
    """Forward and every gradient, for random routings where some experts receive no token at all. fp32
    (grouped_mm has no float64 kernel): within parity.fp32_bound of the three expert matmuls and the
    weighted sum over k, forward and backward (depth 8), over at most `hidden` terms, at each tensor's scale."""
    torch.manual_seed(experts * 10 + k)
    tokens, dim, hidden = 37, 16, 24
    allowed = torch.tensor([e for e in range(experts) if e not in empty])
    choice = torch.rand(tokens, len(allowed)).argsort(dim=-1)[:, :k]  # k distinct experts per token
    routed = allowed[choice]
    x = torch.randn(tokens, dim, requires_grad=True)
    weights = torch.rand(tokens, k, requires_grad=True)
    params = expert_weights(experts, dim, hidden)
    results = []
    for compute in (grouped_experts, looped_experts):
        out = compute(x, routed, weights, *params, F.silu)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), *(t.grad.clone() for t in (x, weights, *params))))
        for t in (x, weights, *params):
            t.grad = None
    assert len(results[0]) == len(results[1]) == 6
    for name, grouped, looped in zip(("output", "x", "weights", "w1", "w3", "w2"), *results):
        bound = fp32_bound(looped.abs().max().item(), max(dim, hidden, k), depth=8)
        parity.close(grouped, looped, atol=bound, what=name)
    for e in empty:  # an expert with no tokens gets exactly zero gradient
        assert all(results[0][3 + i][e].abs().max() == 0 for i in range(3))


@needs_grouped_mm
def test_grouped_path_takes_a_stride_zero_gradient():
    """`.sum()` sends an expanded (stride-0) gradient; grouped_mm's backward would reject it."""
    x = torch.randn(10, 8)
    params = expert_weights(3, 8, 8)
    grouped_experts(x, torch.randint(0, 3, (10, 1)), torch.ones(10, 1), *params, F.silu).sum().backward()
    assert params[0].grad is not None


def test_softmax_router_against_a_direct_computation(parity):
    router = SoftmaxTopK(moe_config(num_experts=6, moe_top_k=2))
    x = torch.randn(20, 32)
    routing = router(x)
    probs = torch.softmax(x @ router.gate.weight.T, dim=-1)
    for t in range(20):
        best = sorted(range(6), key=lambda e: -probs[t, e].item())[:2]
        assert routing.experts[t].tolist() == best
        parity.close(routing.weights[t], probs[t, best], atol=fp32_bound(1.0, 32, 2), what="weights")
    # probabilities ≤ 1 after a dot product over dim and a softmax over 6: fp32_bound(1, 32, 2)
    parity.close(routing.probs, probs, atol=fp32_bound(1.0, 32, 2), what="probabilities")


def test_sigmoid_router_selects_by_biased_scores_and_weighs_by_unbiased_ones(parity):
    router = SigmoidTopK(moe_config(num_experts=5, moe_top_k=2, moe_router="sigmoid_topk"))
    router.bias.copy_(torch.tensor([0.0, 0.5, -0.5, 0.0, 0.2]))
    x = torch.randn(16, 32)
    routing = router(x)
    scores = torch.sigmoid(x @ router.gate.weight.T)
    for t in range(16):
        best = sorted(range(5), key=lambda e: -(scores[t, e] + router.bias[e]).item())[:2]
        assert routing.experts[t].tolist() == best
        expected = scores[t, best] / scores[t, best].sum()
        parity.close(routing.weights[t], expected, atol=fp32_bound(1.0, 32, 3), what="weights")  # + the division


def test_renormalising_softmax_router_picks_the_same_experts_with_weights_summing_to_one(parity):
    """Mixtral's router: SoftmaxTopK's choice and probabilities, its k weights divided by their sum."""
    cfg = moe_config(num_experts=6, moe_top_k=3, moe_router="softmax_topk_renorm")
    torch.manual_seed(0)
    router, plain = SoftmaxTopKRenorm(cfg), SoftmaxTopK(cfg)
    plain.load_state_dict(router.state_dict())
    x = torch.randn(20, 32)
    routing, reference = router(x), plain(x)
    assert torch.equal(routing.experts, reference.experts) and torch.equal(routing.probs, reference.probs)
    expected = reference.weights / reference.weights.sum(dim=-1, keepdim=True)
    assert torch.equal(routing.weights, expected)
    # k = 3 weights ≤ 1 summed, then divided: a sum of 3 and a division rounded in fp32
    parity.close(routing.weights.sum(dim=-1), torch.ones(20), atol=fp32_bound(1.0, 3, 2), what="weight sums")
    assert not torch.allclose(reference.weights.sum(dim=-1), torch.ones(20))  # the plain router's do not sum to 1


GROUPED_ROUTING = [(8, 4, 2, 2), (16, 4, 1, 3), (12, 3, 2, 4), (8, 2, 2, 2), (32, 8, 3, 6)]
"""(num_experts, moe_n_group, moe_topk_group, moe_top_k): groups of 2 to 4 experts, some keeping one group."""


@pytest.mark.parametrize("experts,groups,kept,k", GROUPED_ROUTING)
def test_group_limited_routing_chooses_what_transformers_deepseek_v3_and_glm4_moe_routers_choose(
    experts, groups, kept, k
):
    """Random router weights, inputs and balancing biases: the same experts for every token as transformers'
    DeepseekV3TopkRouter and Glm4MoeTopkRouter (n_group / topk_group / norm_topk_prob, scaling 1), and the same
    weights: each is the same chosen scores divided by their sum (transformers adds 1e-20 to a sum ≥ k·σ_min)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    torch.manual_seed(experts + groups + kept + k)
    cfg = moe_config(
        num_experts=experts, moe_top_k=k, moe_router="sigmoid_topk", moe_n_group=groups, moe_topk_group=kept
    )
    router = SigmoidTopK(cfg)
    router.bias.copy_(torch.randn(experts) * 0.1)
    x = torch.randn(64, 32)
    routing = router(x)
    mask = torch.zeros(64, experts, dtype=torch.bool).scatter_(1, routing.experts, True)
    group_of = torch.arange(experts) // (experts // groups)
    assert all(len(set(group_of[row].tolist())) <= kept for row in routing.experts)  # inside the kept groups
    shared = dict(hidden_size=32, num_experts_per_tok=k, n_group=groups, topk_group=kept, norm_topk_prob=True)
    hf_configs = {
        DeepseekV3TopkRouter: transformers.DeepseekV3Config(
            n_routed_experts=experts, routed_scaling_factor=1.0, **shared
        ),
        Glm4MoeTopkRouter: transformers.Glm4MoeConfig(n_routed_experts=experts, routed_scaling_factor=1.0, **shared),
    }
    assert len(hf_configs) == 2
    for cls, hf_cfg in hf_configs.items():
        theirs = cls(hf_cfg)
        with torch.no_grad():
            theirs.weight.copy_(router.gate.weight)
            theirs.e_score_correction_bias.copy_(router.bias)
            _, weights, indices = theirs(x)
        their_mask = torch.zeros(64, experts, dtype=torch.bool).scatter_(1, indices, True)
        assert torch.equal(mask, their_mask), cls.__name__
        order = routing.experts.argsort(dim=-1)  # transformers' top-k is unsorted: compare expert by expert
        their_order = indices.argsort(dim=-1)
        ours_sorted = routing.weights.gather(1, order)
        theirs_sorted = weights.gather(1, their_order)
        # the same k scores summed and divided, the sum in another order: fp32_bound(1, k, 2)
        torch.testing.assert_close(ours_sorted, theirs_sorted, atol=fp32_bound(1.0, k, 2), rtol=0)


def test_one_expert_group_routes_bitwise_like_the_ungrouped_top_k():
    """moe_n_group = 1 (the default) keeps every expert: the choice is the plain top-k of score + bias, bitwise,
    and the weights are those experts' scores renormalised, bitwise."""
    cfg = moe_config(num_experts=8, moe_top_k=3, moe_router="sigmoid_topk")
    assert (cfg.moe_n_group, cfg.moe_topk_group) == (1, 1)
    torch.manual_seed(3)
    router = SigmoidTopK(cfg)
    router.bias.copy_(torch.randn(8) * 0.2)
    x = torch.randn(50, 32)
    routing = router(x)
    scores = torch.sigmoid(F.linear(x, router.gate.weight))
    experts = (scores + router.bias).topk(3, dim=-1).indices
    chosen = scores.gather(-1, experts)
    assert torch.equal(routing.experts, experts)
    assert torch.equal(routing.weights, chosen / chosen.sum(dim=-1, keepdim=True))


def test_sigmoid_bias_moves_load_toward_balance_without_touching_gradients():
    """A skewed input (every token leans to expert 0) becomes balanced by the bias alone; the bias is a
    buffer (saved in the state dict), never a parameter, and gets no gradient."""
    cfg = moe_config(num_experts=4, moe_top_k=1, moe_router="sigmoid_topk", moe_bias_schedule=[(0, 0.02)])
    router = SigmoidTopK(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        router.gate.weight.normal_(0, 0.1)
        router.gate.weight[0, 0] = 3.0
    x = torch.randn(256, 32)
    x[:, 0] = 1.0

    def imbalance() -> float:
        load = torch.bincount(router(x).experts.flatten(), minlength=4).float()
        return (load.max() / load.mean()).item()

    start = imbalance()
    for _ in range(60):
        routing = router(x)
        routing.weights.sum().backward()
        router.record_load(torch.bincount(routing.experts.flatten(), minlength=4).float())
        grad = router.gate.weight.grad.clone()
        router.apply_bias_update()
        assert torch.equal(router.gate.weight.grad, grad)  # the update leaves gradients alone
        router.gate.weight.grad = None
    assert start == 4.0 and imbalance() < 1.25
    assert router.bias.grad is None and "bias" not in dict(router.named_parameters())
    assert {"bias", "pending_load", "updates"} <= set(router.state_dict())
    assert int(router.updates) == 60


def test_bias_schedule_picks_the_rate_by_update_count():
    router = SigmoidTopK(moe_config(moe_router="sigmoid_topk", moe_bias_schedule=[(0, 0.1), (2, 0.0)]))
    router.record_load(torch.tensor([8.0, 0.0, 0.0, 0.0]))
    router.apply_bias_update()
    torch.testing.assert_close(router.bias, torch.tensor([-0.1, 0.1, 0.1, 0.1]))
    router.apply_bias_update()  # nothing pending: no update, no count
    assert int(router.updates) == 1
    for _ in range(2):
        router.record_load(torch.tensor([8.0, 0.0, 0.0, 0.0]))
        router.apply_bias_update()
    torch.testing.assert_close(router.bias, torch.tensor([-0.2, 0.2, 0.2, 0.2]))  # the third used rate 0


def test_proportional_bias_update_moves_each_expert_by_its_distance_from_the_mean():
    cfg = moe_config(moe_router="sigmoid_topk", moe_bias_schedule=[(0, 0.1)], moe_bias_update="proportional")
    router = SigmoidTopK(cfg)
    router.record_load(torch.tensor([8.0, 0.0, 0.0, 0.0]))  # mean 2: (2 − 8)/2 = −3, (2 − 0)/2 = +1
    router.apply_bias_update()
    torch.testing.assert_close(router.bias, torch.tensor([-0.3, 0.1, 0.1, 0.1]))
    router.record_load(torch.tensor([3.0, 1.0, 2.0, 2.0]))  # near balance: small steps
    router.apply_bias_update()
    torch.testing.assert_close(router.bias, torch.tensor([-0.35, 0.15, 0.1, 0.1]))
    router.apply_bias_update()  # nothing pending: no update, no count
    assert int(router.updates) == 2
    with pytest.raises(ConfigError, match="moe_bias_update"):
        check_config(
            load_job_config(
                REPO / "presets" / "debug_moe.toml",
                [
                    "model.moe_router=softmax_topk",
                    "model.moe_bias_schedule=[[0,0.001]]",
                    "model.moe_bias_update=proportional",
                ],
            ),
            1,
        )


def test_losses_equal_their_formulas_on_hand_made_inputs():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.1, 0.1, 0.8], [0.5, 0.25, 0.25]])
    experts = torch.tensor([[0], [0], [2], [1]])
    # f = [2/4, 1/4, 1/4], P = column means = [0.475, 0.2125, 0.3125]; loss = 3 · Σ f·P
    expected = 3 * (0.5 * 0.475 + 0.25 * 0.2125 + 0.25 * 0.3125)
    assert balance_loss(probs, experts).item() == pytest.approx(expected)
    # two sequences of two tokens: per sequence f and P, then the mean
    first = 3 * (1.0 * 0.65)
    second = 3 * (0.5 * 0.175 + 0.5 * 0.525)  # experts 2 and 1; P = [0.3, 0.175, 0.525]
    assert sequence_balance_loss(probs, experts, batch=2).item() == pytest.approx((first + second) / 2)
    logits = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    lse = torch.tensor(
        [torch.log(torch.tensor(2.0)), torch.log(torch.exp(torch.tensor(1.0)) + torch.exp(torch.tensor(2.0)))]
    )
    assert router_z_loss(logits).item() == pytest.approx(lse.square().mean().item())
    uniform = torch.full((8, 4), 0.25)
    assert balance_loss(uniform, torch.arange(8).view(8, 1) % 4).item() == pytest.approx(1.0)  # balanced → 1


def test_capacity_drops_assignments_beyond_it_in_token_order():
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    kept = within_capacity(experts, 4, capacity=2)
    assert kept.tolist() == [[True, True], [True, True], [False, True], [True, False]]
    moe = MoE(moe_config(moe_capacity_factor=0.5))  # capacity = ceil(0.5 · 8 · 2 / 4) = 2
    _, stats = moe(torch.randn(1, 8, 32))
    assert stats.load.sum() + stats.dropped == 16 and stats.load.max() <= 2


def test_gradient_scale_normalises_each_experts_gradient_by_its_load(parity):
    torch.manual_seed(1)
    x = torch.randn(2, 12, 32)
    grads, loads = [], []
    for scale in (False, True):
        moe = MoE(moe_config(moe_gradient_scale=scale, moe_aux_loss_weight=0.0))
        torch.manual_seed(2)
        for p in moe.parameters():
            p.data.normal_(0, 0.2)
        out, stats = moe(x)
        out.square().sum().backward()
        grads.append(moe.experts.w1.grad.clone())
        loads.append(stats.load)
    factor = loads[1].mean() / loads[1].clamp(min=1)
    # the scale enters inside the backward (another order of the same products): the MoE layer's forward
    # and backward matmuls over at most its FFN width, and the scaling, at the gradient's scale
    cfg = moe_config()
    bound = fp32_bound(grads[0].abs().max().item() * factor.max().item(), max(cfg.dim, cfg.ffn_dim), depth=7)
    parity.close(grads[1], grads[0] * factor.view(-1, 1, 1), atol=bound, what="w1 gradient")


@pytest.mark.parametrize(
    "fields",
    [
        dict(num_experts=4, moe_top_k=2),
        dict(num_experts=8, moe_top_k=2, moe_frequency=2, moe_shared_experts=2, moe_expert_ffn_multiplier=0.25),
        dict(num_experts=3, moe_top_k=1, moe_packed_experts=False, moe_router="sigmoid_topk", tie_embeddings=True),
    ],
)
def test_parameter_counts_total_and_active(fields):
    cfg = moe_config(n_layers=3, **fields)
    counts = param_counts(cfg)
    model = Transformer(cfg)
    assert model.num_parameters() == counts["total"]
    per_expert = 3 * cfg.dim * cfg.expert_ffn_dim
    inactive = cfg.moe_layers * (cfg.num_experts - cfg.moe_top_k) * per_expert
    assert counts["active"] == counts["total"] - inactive
    dense = ModelConfig(**{k: v for k, v in cfg.model_dump().items() if not k.startswith(("moe_", "num_experts"))})
    # active FLOPs: the dense model's, with each MoE block's MLP swapped for router + top_k + shared experts
    mlp_delta = cfg.moe_layers * (
        cfg.num_experts * cfg.dim + (cfg.moe_top_k + cfg.moe_shared_experts) * per_expert - 3 * cfg.dim * cfg.ffn_dim
    )
    assert training_flops_per_token(cfg, 16) == training_flops_per_token(dense, 16) + 6 * mlp_delta


def test_moe_frequency_places_moe_in_every_nth_block():
    model = Transformer(moe_config(n_layers=4, moe_frequency=2))
    assert [isinstance(b.feed_forward, MoE) for b in model.layers.values()] == [False, True, False, True]


def test_a_dense_model_is_unchanged():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=97)
    model = Transformer(cfg)
    assert not any("expert" in k or "router" in k for k in model.state_dict())
    model(torch.randint(0, 97, (1, 5)))
    assert model.moe_loss() is None and moe_metrics(model) == {}


def train_steps(model: Transformer, tokens: torch.Tensor, steps: int) -> list[float]:
    from engine.config.train import TrainConfig
    from engine.train.balancing import attach_router_balancing
    from engine.train.losses import build_loss

    loss_fn = build_loss(TrainConfig())
    attach_router_balancing(model)  # as the trainer does
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = loss_fn(model, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid_topk"])
def test_activation_checkpointing_gives_the_same_losses(router, parity):
    """The recomputation in backward must route as the forward did and must not count aux losses twice: bit
    for bit (the same kernels on the same inputs in one process)."""
    cfg = moe_config(
        moe_router=router,
        moe_sequence_aux_loss_weight=0.01,
        moe_router_z_loss_weight=0.01,
        moe_bias_schedule=[(0, 0.05)] if router == "sigmoid_topk" else [(0, 1e-3)],
    )
    torch.manual_seed(0)
    plain = Transformer(cfg)
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing(checkpointed, "full")
    tokens = torch.randint(0, 97, (2, 17))
    expected = train_steps(plain, tokens, 4)
    losses = train_steps(checkpointed, tokens, 4)
    assert len(losses) == len(expected) == 4
    parity.close(torch.tensor(losses), torch.tensor(expected), atol=0, what="losses")
    parity.close(checkpointed.state_dict(), plain.state_dict(), atol=0, what="weights and router buffers")


def test_training_loss_adds_the_aux_losses_and_eval_loss_does_not():
    from engine.config.train import TrainConfig
    from engine.train.losses import build_loss, cross_entropy

    model = Transformer(moe_config(moe_aux_loss_weight=0.5, moe_router_z_loss_weight=0.1))
    tokens = torch.randint(0, 97, (2, 9))
    loss_fn = build_loss(TrainConfig())
    train_loss = loss_fn(model, tokens[:, :-1], tokens[:, 1:])
    stats = model.last_moe_stats.values()
    aux = sum(0.5 * s.balance_loss + 0.1 * s.z_loss for s in stats)
    ce = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    assert train_loss.item() == pytest.approx((ce + aux).item(), rel=1e-6)
    assert loss_fn(model, tokens[:, :-1], tokens[:, 1:], z_loss=False).item() == pytest.approx(ce.item(), rel=1e-6)


def test_balancing_applies_each_training_forwards_load_at_the_start_of_the_next_one():
    """Per training forward (micro-batch), not per optimizer step; forwards without gradient or in eval mode
    neither apply nor record; without the training hooks the model's forward changes no router state."""
    from engine.train.balancing import attach_router_balancing

    model = Transformer(moe_config(moe_router="sigmoid_topk", moe_bias_schedule=[(0, 0.05)]))
    router = model.layers["1"].feed_forward.router
    tokens = torch.randint(0, 97, (2, 9))
    model(tokens).sum().backward()
    assert int(router.updates) == 0 and not router.pending_load.any() and not router.bias.any()
    attach_router_balancing(model)
    model(tokens).sum().backward()
    pending = router.pending_load.clone()
    assert pending.sum() == 2 * 9 * 2 and int(router.updates) == 0  # recorded, not applied yet
    with torch.no_grad():
        model(tokens)
    model.eval()
    model(tokens)
    model.train()
    assert torch.equal(router.pending_load, pending) and int(router.updates) == 0 and not router.bias.any()
    model(tokens).sum().backward()  # applies the previous forward's load, then records its own
    assert int(router.updates) == 1 and router.bias.any() and router.pending_load.sum() == 2 * 9 * 2


def test_router_state_survives_a_state_dict_round_trip():
    """Bias, pending load and update count come back exactly. (The bias itself may be back at 0 after two
    updates of opposite sign, so the state is shown to be non-trivial by its count and pending load.)"""
    torch.manual_seed(0)
    cfg = moe_config(moe_router="sigmoid_topk", moe_bias_schedule=[(0, 0.05)])
    model = Transformer(cfg)
    train_steps(model, torch.randint(0, 97, (2, 17)), 3)
    router = model.layers["1"].feed_forward.router
    assert int(router.updates) == 2 and router.pending_load.sum() == 2 * 16 * 2  # 3 forwards: 2 applied, 1 pending
    restored = Transformer(cfg)
    restored.load_state_dict(model.state_dict())
    for name in ("bias", "pending_load", "updates"):
        assert torch.equal(getattr(restored.layers["1"].feed_forward.router, name), getattr(router, name))


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["model.moe_top_k=1"], "model.moe_top_k"),
        (["model.moe_shared_experts=1"], "model.moe_shared_experts"),
        (["model.num_experts=2", "model.moe_top_k=3"], "model.moe_top_k"),
        (["model.num_experts=4", "model.moe_bias_schedule=[[0,0.01]]"], "model.moe_bias_schedule"),
        (["model.num_experts=4", "model.moe_frequency=9"], "model.moe_frequency"),
        (["model.num_experts=4", "model.moe_n_group=2"], "model.moe_n_group"),
        (["model.num_experts=6", "model.moe_router=sigmoid_topk", "model.moe_n_group=4"], "model.moe_n_group"),
        (["model.num_experts=6", "model.moe_router=sigmoid_topk", "model.moe_n_group=6"], "model.moe_n_group"),
        (
            ["model.num_experts=8", "model.moe_router=sigmoid_topk", "model.moe_n_group=2", "model.moe_topk_group=3"],
            "model.moe_topk_group",
        ),
        (
            [
                "model.num_experts=8",
                "model.moe_router=sigmoid_topk",
                "model.moe_n_group=4",
                "model.moe_topk_group=1",
                "model.moe_top_k=3",
            ],
            "model.moe_top_k",
        ),
    ],
)
def test_config_rejects_moe_fields_that_would_do_nothing_or_cannot_work(overrides, field):
    with pytest.raises(ConfigError) as err:
        check_config(load_job_config(REPO / "presets" / "debug.toml", overrides))
    assert field in str(err.value)


def test_bias_schedule_must_start_at_zero_and_increase():
    for schedule in ([(5, 0.1)], [(0, 0.1), (0, 0.0)], [(0, -1.0)]):
        with pytest.raises(ValueError, match="moe_bias_schedule"):
            moe_config(moe_router="sigmoid_topk", moe_bias_schedule=schedule)


def test_moe_fields_may_not_change_on_resume():
    from engine.config.changes import resume_issues

    preset = REPO / "presets" / "debug_moe.toml"
    saved = load_job_config(preset)
    changed = load_job_config(preset, ["model.moe_aux_loss_weight=0.5", "model.moe_top_k=1"])
    assert {issue.path for issue in resume_issues(saved, changed)} == {"model.moe_aux_loss_weight", "model.moe_top_k"}


TINY_MOE = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "train.seq_len=32",
    "model.max_seq_len=64",
    "train.batch_size=4",
    "train.max_steps=4",
    "metrics.log_interval=1",
    "eval.enabled=false",
    "scheduler.warmup_steps=1",
    "checkpoint.interval=2",
    "scheduler.decay_steps=3",
    "model.moe_bias_schedule=[[0,0.01]]",
]


def test_trainer_logs_expert_load_resumes_exactly_and_matches_under_activation_checkpointing(tmp_path, parity):
    from engine.train.trainer import train

    def run(name: str, *extra: str) -> list[dict]:
        cfg = load_job_config(REPO / "presets" / "debug_moe.toml", [*TINY_MOE, *extra])
        train(cfg, tmp_path / name)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if "loss" in r]

    plain = run("plain")
    assert all(r["moe/imbalance"] >= 1.0 and "moe/1/balance_loss" in r and "moe/1/bias_max" in r for r in plain)
    assert all("moe/1/load_cv" in r and "moe/1/dead_experts" in r and "moe/imbalance_layer" in r for r in plain)
    assert plain[-1]["moe/1/bias_max"] > 0  # the balancing bias moved
    checkpointed = run("ac", "train.activation_checkpointing=full")
    # recomputation runs the same kernels on the same inputs: bit for bit
    assert len(checkpointed) == len(plain) > 0
    parity.close(
        torch.tensor([r["loss"] for r in checkpointed]), torch.tensor([r["loss"] for r in plain]), atol=0, what="losses"
    )
    run("resumed", "train.max_steps=2")
    resumed = run("resumed")  # continues from the step-2 checkpoint: router bias and load come back with it
    assert [(r["loss"], r["moe/1/bias_max"]) for r in resumed if r["step"] > 2] == [
        (r["loss"], r["moe/1/bias_max"]) for r in plain if r["step"] > 2
    ]


def forge_train(tmp_path: Path, *args: str):
    from tests.helpers.cli import forge

    run_dir = tmp_path / "run"
    result = forge(
        "train",
        *args,
        "--run-dir",
        str(run_dir),
        "--train.max_steps=4",
        "--metrics.log_interval=1",
        "--eval.enabled=false",
        "--scheduler.warmup_steps=1",
        "--train.batch_size=2",
        "--train.seq_len=64",
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return result.stdout, [r for r in records if "loss" in r]


@pytest.mark.slow
def test_debug_moe_preset_trains_through_the_cli(tmp_path):
    stdout, records = forge_train(tmp_path, "presets/debug_moe.toml", "--model.n_layers=2")
    assert "active per token" in stdout and "expert_imbalance=" in stdout
    assert len(records) == 4 and all("moe/imbalance" in r and "moe/0/bias_max" in r for r in records)


@pytest.mark.slow
def test_dense_preset_becomes_moe_by_one_field_on_the_command_line(tmp_path):
    stdout, records = forge_train(
        tmp_path, "presets/debug.toml", "--model.num_experts=8", "--model.moe_top_k=2", "--model.n_layers=2"
    )
    assert "expert_imbalance=" in stdout and "moe/1/balance_loss" in records[-1]


def test_an_moe_model_compiles_around_its_routed_experts_outside_bf16():
    """fp32 (CPU): the MoE blocks compile in regions (attention, router, shared experts; the routed experts,
    norms and block stay eager); in bf16 without ep and tp they compile whole. Nothing runs here: parity and
    proof that the regions compile are tests/parallel/test_expert_parallel.py's compiled cases."""
    from engine.parallel.apply import parallelize

    def compiled(**overrides: str) -> Transformer:
        cfg = load_job_config(
            REPO / "presets" / "debug_moe.toml",
            ["train.compile_model=true", *(f"train.{k}={v}" for k, v in overrides.items())],
        )
        return parallelize(Transformer(moe_config(moe_shared_experts=1)), cfg)  # on the CPU

    for block in compiled(mixed_precision="fp32").layers.values():
        moe = block.feed_forward
        regions = [block.attention, moe.router, moe.shared]
        assert all(m._compiled_call_impl is not None for m in regions)
        assert block._compiled_call_impl is None and moe._compiled_call_impl is None
        assert moe.experts._compiled_call_impl is None and block.ffn_norm._compiled_call_impl is None
    for precision in ("bf16", "auto"):  # auto is fp32 on the CPU
        whole = precision == "bf16"
        blocks = compiled(mixed_precision=precision, activation_checkpointing="none").layers.values()
        assert all((b._compiled_call_impl is not None) == whole for b in blocks), precision


@pytest.mark.parametrize("layout", [[], ["distributed.ep=2"]])
def test_checkpointing_an_moe_model_compiled_in_regions_is_refused(layout):
    """A checkpointed block must recompute exactly what its forward ran; PyTorch reruns compiled regions inside
    an eager checkpoint without dynamo. Refused by validation (field named) where the dtype is known, else by
    parallelize once "auto" resolves (fp32 on the CPU); bf16 without ep compiles whole and is allowed."""
    from engine.errors import UserError
    from engine.parallel.apply import parallelize

    def config(*extra: str):
        overrides = ["train.compile_model=true", "train.activation_checkpointing=selective", *layout, *extra]
        return load_job_config(REPO / "presets" / "debug_moe.toml", overrides)

    world = 2 if layout else 1
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing"):
        check_config(config("train.mixed_precision=fp32"), world)
    cfg = config("train.mixed_precision=bf16")
    if layout:
        with pytest.raises(ConfigError, match=r"train\.activation_checkpointing"):
            check_config(cfg, world)
        return
    check_config(cfg, world)  # bf16 on one device: the blocks compile whole, checkpoint wrapper included
    auto = config()
    check_config(auto, world)
    with pytest.raises(UserError, match=r"train\.activation_checkpointing"):
        parallelize(Transformer(moe_config()), auto)


def test_validate_config_accepts_expert_parallelism_with_compile_and_names_what_it_still_refuses():
    from tests.helpers.cli import forge

    layout = ["--world-size", "2", "--distributed.ep=2", "--train.compile_model=true"]
    assert forge("validate-config", "presets/debug_moe.toml", *layout).returncode == 0
    refused = forge("validate-config", "presets/debug_moe.toml", *layout, "--train.activation_checkpointing=full")
    assert refused.returncode == 2 and "train.activation_checkpointing" in refused.stderr, refused.stderr


def test_compiling_an_moe_model_under_tensor_parallelism_is_accepted():
    """Once refused (a shared on-disk AOTAutograd cache handed one tp rank the other's backward); each rank now
    compiles into a cache of its own (engine.parallel.launch.use_rank_compile_cache), and tests/
    test_expert_parallel.py's `tp_compile*` cases train it against one process, cold and warm."""
    overrides = ["train.compile_model=true", "distributed.tp=2", "distributed.dp_shard=1"]
    for precision in ("fp32", "bf16"):  # in regions, and whole
        check_config(
            load_job_config(REPO / "presets" / "debug_moe.toml", [*overrides, f"train.mixed_precision={precision}"]), 2
        )


def test_validate_config_reports_total_and_active_parameters():
    from tests.helpers.cli import forge

    report = json.loads(forge("validate-config", "presets/debug_moe.toml", "--json").stdout)
    cfg = load_job_config(REPO / "presets" / "debug_moe.toml")
    assert (
        report["parameters"] == param_counts(cfg.model)
        and report["parameters"]["active"] < report["parameters"]["total"]
    )
    assert report["flops_per_token"] == training_flops_per_token(cfg.model, cfg.train.seq_len)
    table = forge("validate-config", "presets/debug_moe.toml").stdout
    assert "parameters (active per token)" in table and "training FLOPs per token (active)" in table


@pytest.mark.slow
@pytest.mark.timeout(900)  # inductor's cache may be cold on a fresh machine
def test_compiled_moe_blocks_match_eager_under_bf16(tmp_path):
    """Compiled bf16 against eager bf16: both autocast (bf16 logits; in bf16 the MoE blocks compile whole,
    grouped_mm included, engine.parallel.apply.check_compilable), the compiled run is not fp32's, and the
    two differ only by rounding: tests/train/test_trainer.py's `rounding_tolerance` with 12 roundings, each run's
    own 6 (the compiled graph keeps in fp32 what eager rounds, so the two round independently): the head's
    3 and the router gate's 3 (its input, weights and scores, which weigh every routed expert's output).
    4 steps of 4 × 32 tokens, logits of rms 0.18: 3.0e-3 allowed. Measured (torch 2.13, CPU), the largest
    per-step loss difference is 7.1e-4 between compiled and eager (4 times under) and 4.8e-4 between
    compiled and fp32."""
    from torch._dynamo.utils import counters

    from engine.train.trainer import train
    from tests.helpers.trainer import ComputeDtypes, rounding_tolerance

    def run(name: str, *extra: str) -> tuple[list[float], ComputeDtypes]:
        cfg = load_job_config(REPO / "presets" / "debug_moe.toml", [*TINY_MOE, "train.mixed_precision=bf16", *extra])
        dtypes = ComputeDtypes()
        train(cfg, tmp_path / name, callbacks=[dtypes])
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, lines) if "loss" in r], dtypes

    torch._dynamo.reset()  # compile afresh, and count only this run's graphs
    counters.clear()
    compiled, compiled_dtypes = run("compiled", "train.compile_model=true")
    graphs = counters["stats"]["unique_graphs"], counters["aot_autograd"]["total"]
    (eager, eager_dtypes), (fp32, fp32_dtypes) = run("eager"), run("fp32", "train.mixed_precision=fp32")
    # It ran compiled: the two MoE blocks share one whole graph (fullgraph), its backward built by AOTAutograd.
    assert graphs == (1, 1), dict(counters)
    assert compiled_dtypes.seen == eager_dtypes.seen == {(torch.bfloat16, torch.bfloat16)}
    assert fp32_dtypes.seen == {(None, torch.float32)}
    assert len(compiled) == len(eager) == len(fp32) == 4
    tolerance = rounding_tolerance(torch.bfloat16, eager_dtypes.logits_rms, tokens=4 * 32, steps=4, roundings=12)
    print(
        f"max |compiled - eager| = {max(abs(a - b) for a, b in zip(compiled, eager)):.2e} (allowed {tolerance:.2e}), "
        f"max |compiled - fp32| = {max(abs(a - b) for a, b in zip(compiled, fp32)):.2e}"
    )
    assert compiled == pytest.approx(eager, abs=tolerance) and compiled != fp32
