"""Expert parallelism on CPU under torchrun (gloo): ep = 2 trains as plain data parallelism (ep = 1) over the
same ranks and data — 6 AdamW steps with gradient clipping; per-step losses, first-step gradients, gradient
norms and final parameters within the fp32 tolerances of tests/helpers/parity.TrainingTolerance (fp32: grouped_mm has
no float64 kernel) — for both routers, shared experts, capacity, the loop implementation,
a rank that receives no token at all, full and selective activation checkpointing, torch.compile (the MoE
blocks compiled around their routed experts, fp32, the compiled graphs counted), and with FSDP (2 ranks,
and 4 ranks where each expert shard is FSDP-sharded over 2). In the same launch, MoE under tp = 2 with full
checkpointing (the sigmoid router, group-limited) and selective checkpointing (Mixtral's renormalising
router), and compiled twice (the second compile loads the first's on-disk AOTAutograd cache, which each rank
keeps for itself), against one process on the union of the ranks' batches. DCP checkpoints go both
ways between the sharded and an unsharded model, and the sharded run's checkpoint, in one process, gives the
uninterrupted run's next loss. Plus the validation rules, the module's two expert implementations, and in
one process the layout's seam: hooks on the experts module, no method patched on an instance."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from engine.config import load_job_config
from engine.config.model import ModelConfig
from engine.errors import UserError
from engine.model.moe import GROUPED_MM
from engine.model.transformer import Transformer
from engine.parallel.expert import apply_expert_parallel
from tests.helpers import layouts
from tests.helpers.layouts import MOE, assert_same_run, forge, records
from tests.helpers.parity import Parity, TrainingTolerance, fp32_bound
from tests.helpers.torchrun import torchrun

# The model every case starts from (a case's "model" overrides it).
MODEL = dict(
    dim=32,
    n_layers=2,
    n_heads=4,
    vocab_size=64,
    max_seq_len=16,
    num_experts=4,
    moe_top_k=2,
    moe_aux_loss_weight=0.01,
    moe_router_z_loss_weight=0.001,
)
SCRIPT = r"""
import json, sys
from pathlib import Path
import torch, torch.distributed as dist, torch.nn.functional as F
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch._dynamo.utils import counters
from engine.config.model import ModelConfig
from engine.model.transformer import Transformer
from engine.parallel.apply import apply_activation_checkpointing, apply_compile
from engine.parallel.expert import apply_expert_parallel, fully_shard_experts, shard_experts
from engine.parallel.tp import apply_tensor_parallel
from engine.parallel.grad_norm import clip_grad_norm
from engine.train.balancing import all_reduce_router_load, attach_router_balancing
from engine.parallel.launch import join_process_group

join_process_group("gloo", 300, torch.device("cpu"))  # as forge: a compile cache for this rank alone
out, cases, MODEL = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
rank, world, ep = dist.get_rank(), dist.get_world_size(), 2
STEPS, BATCH, SEQ = 6, 2, 16
mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("expert_dp", "ep"))
dp_mesh = mesh._flatten("dp")
tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))  # the "tp" layout: all ranks, no dp


def rank_batches(r):  # each dp rank its own data, the same in every layout; one more for the resumed step
    generator = torch.Generator().manual_seed(100 + r)
    return [torch.randint(0, 64, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS + 1)]


batches = rank_batches(rank)
# One process (and every tp rank, which sees all of the layer's tokens) trains on the union of the ranks' batches.
global_batches = [torch.cat(step) for step in zip(*(rank_batches(r) for r in range(world)))]
DATA_PARALLEL = ("dp", "ep", "ep_fsdp")


def build(cfg, case, layout):
    torch.manual_seed(0)
    model = Transformer(cfg)
    for router in model.moe_routers().values():
        if "bias" in case:
            router.bias.copy_(torch.tensor(case["bias"]))
    for block in model.layers.values():
        block.feed_forward.implementation = case.get("implementation", "grouped")
    if layout in ("ep", "ep_fsdp"):
        apply_expert_parallel(model, mesh["ep"])
    if layout == "tp":  # as engine.parallel.apply: TP, then the routed experts' hidden units over tp
        apply_tensor_parallel(model, tp_mesh, loss_parallel=False)
        shard_experts(model, None, tp_mesh)
    apply_activation_checkpointing(model, case.get("activation_checkpointing", "none"))
    if case.get("compile") and layout not in ("dp", "one"):  # the references stay eager
        apply_compile(model, moe_regions=True)  # fp32: the MoE blocks compile around the routed experts
    if layout == "ep_fsdp":
        fully_shard_experts(model, mesh["expert_dp"])
        for block in model.layers.values():
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    attach_router_balancing(model)  # the loads are summed over the dp ranks in `train`, after each backward
    return model


def average_gradients(model):
    # Plain data parallelism without FSDP: experts over the ranks holding the same experts, the rest over all.
    for param in model.parameters():
        if isinstance(param, DTensor):
            grad, group = param.grad.to_local(), mesh["expert_dp"].get_group()
        else:
            grad, group = param.grad, dp_mesh.get_group()
        dist.all_reduce(grad, group=group)
        grad /= dist.get_world_size(group)


SGD_LR = 0.1


def train(cfg, case, layout):
    model = build(cfg, case, layout)
    if case.get("optimizer") == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    losses, norms, first_grads = [], [], None
    for batch in data(layout)[:STEPS]:
        loss = step_loss(model, batch)
        loss.backward()
        if layout in DATA_PARALLEL:
            all_reduce_router_load(model, dp_mesh.get_group())
        if layout in ("dp", "ep"):
            average_gradients(model)
        if first_grads is None:
            first_grads = full({name: param.grad for name, param in model.named_parameters()})
        norm = clip_grad_norm(model.parameters(), 0.5)  # the norms are about 1: this clips every step
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        norms.append(norm.item())
    return model, losses, norms, first_grads


def data(layout):
    return batches if layout in DATA_PARALLEL else global_batches


def step_loss(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()) + model.moe_loss()


def full(state):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


for name, case in cases.items():
    cfg = ModelConfig(**{**MODEL, **case["model"]})
    reference, reference_losses, reference_norms, reference_grads = train(cfg, case, case.get("reference", "dp"))
    torch._dynamo.reset()  # each compiled case compiles afresh, and counts only its own graphs
    counters.clear()
    model, losses, norms, grads = train(cfg, case, case["layout"])
    compiled = dict(graphs=counters["stats"]["unique_graphs"],
                    cache_hits=counters["aot_autograd"]["autograd_cache_hit"])
    # Adam hides a uniform gradient scale, so the averaged gradients of the first step are compared directly.
    worst_grad = max((((grads[k] - g).abs().max() / g.abs().max()).item(), k) for k, g in reference_grads.items())
    expected = reference.state_dict()
    got = full(model.state_dict())
    worst_param = max(((got[k] - v).abs().max().item(), k) for k, v in expected.items())
    experts = {k: [v.device_mesh.mesh_dim_names, str(v.placements[-1])] for k, v in model.state_dict().items()
               if isinstance(v, DTensor) and ".experts." in k}
    # The sharded checkpoint loads into a plain (ep = 1) model: full expert tensors under the same names.
    dcp.save({"model": model.state_dict()}, checkpoint_id=out / name)
    restored = Transformer(cfg)
    state = {"model": restored.state_dict()}
    dcp.load(state, checkpoint_id=out / name)
    worst_restored = max(((state["model"][k] - v).abs().max().item(), k) for k, v in expected.items())
    # Resumed in one process, the next step's loss is the uninterrupted reference's (the balancing bias first
    # takes the checkpointed pending load, as in the reference).
    attach_router_balancing(restored)
    with torch.no_grad():
        next_losses = [step_loss(m, data(case.get("reference", "dp"))[STEPS]).item() for m in (restored, reference)]
    # And the other way: the plain model's checkpoint loads into a freshly sharded one.
    dcp.save({"model": reference.state_dict()}, checkpoint_id=out / f"{name}_plain")
    state = {"model": build(cfg, case, case["layout"]).state_dict()}
    dcp.load(state, checkpoint_id=out / f"{name}_plain")
    resharded = full(state["model"])
    worst_restored = max(worst_restored, *(((resharded[k] - v).abs().max().item(), k) for k, v in expected.items()))
    bias = max((r.bias.abs().max().item() for r in model.moe_routers().values() if hasattr(r, "bias")), default=0)
    largest = max(v.abs().max().item() for v in expected.values() if v.is_floating_point())
    params = sum(v.numel() for v in expected.values() if v.is_floating_point())
    local = model.layers["0"].feed_forward.experts.w1.to_local().shape[0] if case["layout"] == "ep" else None
    (out / f"{name}_rank{rank}.json").write_text(json.dumps(dict(
        reference=reference_losses, losses=losses, reference_norms=reference_norms, norms=norms,
        worst_grad=worst_grad, worst_param=worst_param, worst_restored=worst_restored, expert_params=experts,
        local_experts=local, bias=bias, next_losses=next_losses, largest=largest, params=params, **compiled)))
dist.barrier()
dist.destroy_process_group()
from engine.parallel.launch import end_process
end_process(0)  # leave without interpreter teardown while gloo's threads live (see end_process)
"""

# Shared experts (sharded like a dense MLP under tp) and the balancing bias (which must move identically).
TP_MOE = dict(moe_router="sigmoid_topk", moe_shared_experts=1, moe_bias_schedule=[(0, 0.01)])
CASES = {
    "softmax": dict(layout="ep", model={}),
    "sigmoid_shared_capacity": dict(
        layout="ep",
        activation_checkpointing="full",
        model=dict(
            moe_router="sigmoid_topk",
            moe_shared_experts=1,
            moe_capacity_factor=1.0,
            moe_aux_loss_weight=0.0,
            moe_sequence_aux_loss_weight=0.01,
            moe_bias_schedule=[(0, 0.01)],
        ),
    ),
    # Experts 2 and 3 (rank 1's) are never chosen: rank 1 receives no token at all, and sends all of its own.
    "uneven_loop": dict(
        layout="ep",
        implementation="loop",
        bias=[0.0, 0.0, -100.0, -100.0],
        model=dict(moe_router="sigmoid_topk", moe_bias_schedule=[(0, 0.0)]),
    ),
    "uneven_grouped": dict(
        layout="ep",
        activation_checkpointing="selective",
        bias=[0.0, 0.0, -100.0, -100.0],
        model=dict(moe_router="sigmoid_topk", moe_bias_schedule=[(0, 0.0)]),
    ),
    # With group-limited routing (2 groups of 2 experts, one kept): each group is one ep rank's experts.
    "fsdp": dict(
        layout="ep_fsdp",
        activation_checkpointing="full",
        model=dict(moe_router="sigmoid_topk", moe_shared_experts=1, moe_n_group=2, moe_topk_group=1),
    ),
    # torch.compile (engine.parallel.apply.apply_compile) against the eager reference: the MoE blocks compile
    # around the routed experts, whose all-to-all runs eagerly.
    "compile": dict(layout="ep", compile=True, model=dict(moe_router="sigmoid_topk", moe_shared_experts=1)),
    # MoE under tp = 2 (no data parallelism) against one process on the union of the ranks' batches, under each
    # activation checkpointing mode: with selective checkpointing Mixtral's router (softmax, top-k weights
    # renormalised), with full checkpointing the sigmoid router with its balancing bias and group-limited
    # routing (2 groups of 2 experts, one kept: DeepSeek-V3's node-limited choice).
    # Trained with SGD: see `learning_rates`.
    "tp_selective": dict(
        layout="tp",
        reference="one",
        activation_checkpointing="selective",
        optimizer="sgd",
        model=dict(moe_router="softmax_topk_renorm", moe_shared_experts=1),
    ),
    "tp_full": dict(
        layout="tp",
        reference="one",
        activation_checkpointing="full",
        model=dict(**TP_MOE, moe_n_group=2, moe_topk_group=1),
    ),
    # And compiled (fp32: in regions), twice: the second compile loads what the first saved in the on-disk
    # AOTAutograd cache, which without a cache per rank hands one rank the other's backward (see
    # engine.parallel.launch.use_rank_compile_cache).
    "tp_compile": dict(layout="tp", reference="one", compile=True, model=dict(moe_router="sigmoid_topk")),
    "tp_compile_warm": dict(layout="tp", reference="one", compile=True, model=dict(moe_router="sigmoid_topk")),
}


SGD_LR = 0.1
"""The learning rate of the cases with `optimizer = "sgd"` (the script defines the same)."""

LAUNCH_TIMEOUT = 420
"""Seconds torchrun gets for one launch of the cases: all of CASES on 2 ranks took 273 s alone on 2 shared cores
(2026-11-26), the 4-rank one 45 s. The tests that launch get pytest's limit `LAUNCH_TIMEOUT + 60` (above the
suite's 300 s, which the launch alone nearly fills): torchrun's limit fires first, so a hang ends as a failure
with the ranks' output and every process killed, before pytest's timeout would kill the test without them."""


def run_cases(tmp_path: Path, nproc: int, cases: dict) -> dict[str, list[dict]]:
    """Every case in one torchrun launch (start-up dominates on CPU) → case → the records of the ranks."""
    script = tmp_path / "ep.py"
    script.write_text(SCRIPT)
    result = torchrun(script, nproc, str(tmp_path), json.dumps(cases), json.dumps(MODEL), timeout=LAUNCH_TIMEOUT)
    assert result.returncode == 0, result.stdout[-4000:]
    return {name: [json.loads((tmp_path / f"{name}_rank{r}.json").read_text()) for r in range(nproc)] for name in cases}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    return run_cases(tmp_path_factory.mktemp("ep2"), 2, CASES)


def tolerance(record: dict, case: dict) -> TrainingTolerance:
    """The script's sizes: 2 ranks' batches of 2 × 16 tokens per step (the tp layouts: one process's union)."""
    cfg = ModelConfig(**{**MODEL, **case["model"]})
    tokens = 2 * 2 * 16
    return TrainingTolerance.of(cfg, seq=16, tokens=tokens, params=record["params"], loss_scale=math.log(64))


def learning_rates(case: dict) -> list[float]:
    """The script's 6 steps' learning rates. The weight bound (TrainingTolerance.weights) takes each update to
    move an entry by at most lr × its gradient's relative difference: true of SGD (lr · g, every |g| ≤ 0.5
    after clipping), not of Adam for an entry whose own gradient is near the rounding level of the largest one
    (its update is about lr · sign(g), whatever its size). Data and expert parallelism sum as the reference
    does and never meet this; tp = 2 against one process does (measured with the softmax routers: 1.4e-6 to
    1.9e-5 after 6 Adam steps against a bound of 9e-7; the sigmoid router's load buffer, about 46, sets
    `largest` and so the bound of the other tp cases), so `optimizer = "sgd"` cases train with plain SGD."""
    return [SGD_LR if case.get("optimizer") == "sgd" else 1e-3] * 6


def check_parity(parity: Parity, records: list[dict], case: dict) -> None:
    layout = case["layout"]
    for rank, record in enumerate(records):
        tol = tolerance(record, case)
        assert len(record["losses"]) == len(record["reference"]) == len(record["norms"]) == 6
        for step, (ours, ref) in enumerate(zip(record["losses"], record["reference"]), 1):
            parity.within(f"rank {rank} loss step {step}", abs(ours - ref), tol.loss_at(step))
        for step, (ours, ref) in enumerate(zip(record["norms"], record["reference_norms"]), 1):
            parity.within(f"rank {rank} grad norm step {step}", abs(ours / ref - 1), tol.norm_at(step))
        # the first step's gradients, relative to the largest entry
        parity.within(f"rank {rank} first gradients ({record['worst_grad'][1]})", record["worst_grad"][0], tol.grad)
        weights = tol.weights(learning_rates(case), record["largest"])
        parity.within(f"rank {rank} weights ({record['worst_param'][1]})", record["worst_param"][0], weights)
        parity.within(f"rank {rank} restored weights", record["worst_restored"][0], weights)
        resumed, uninterrupted = record["next_losses"]
        parity.within(f"rank {rank} resumed step 7 loss", abs(resumed - uninterrupted), tol.loss_at(7))
        experts = record["expert_params"]
        assert len(experts) == 6, experts  # w1, w3, w2 of both MoE layers
        for name, (dims, placement) in experts.items():
            if layout == "tp":  # the hidden units split over tp: w1, w3 [E, dim, hidden], w2 [E, hidden, dim]
                assert dims == ["tp"] and placement == f"S({2 if name.endswith(('w1', 'w3')) else 1})", name
            else:  # whole experts over ep (and FSDP over the ranks holding the same ones)
                assert dims[-1] == "ep" and placement == "S(0)", name
    different = len({tuple(r["losses"]) for r in records})
    assert different == (1 if layout == "tp" else len(records))  # tp ranks share their data, dp ranks do not


def check_compiled(records: list[dict], compiled: bool, layout: str) -> None:
    """Compile really ran: the regions of each MoE block (engine.parallel.apply.compiled_regions) were
    compiled, each to one graph. (They compile with fullgraph, so a graph break would have raised: counting
    the graphs is the check that can fail.)"""
    for record in records:
        if not compiled:
            assert record["graphs"] == 0
            continue
        # Attention, router and shared experts: one whole graph each (fullgraph), reused by the second block.
        # Under tp (no shared experts there) the attention's and the router's tp pre-hooks compile as frames of
        # their own, the router's once per block (it reads the block's gate weight): 2 + 1 + 2.
        assert record["graphs"] == (5 if layout == "tp" else 3), record


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)  # the first case pays the module fixture's launch
@pytest.mark.parametrize("name", list(CASES))
def test_ep2_matches_data_parallel_ep1(two_ranks, name, parity):
    """dp = 2 with ep = 2 against dp = 2 with ep = 1, same data per rank (tp cases: tp = 2 against one process
    on the union of the ranks' batches): losses and parameters within the derived fp32 tolerances, compiled
    where the case says."""
    records = two_ranks[name]
    check_parity(parity, records, CASES[name])
    check_compiled(records, CASES[name].get("compile", False), CASES[name]["layout"])
    if CASES[name]["layout"] == "ep":
        assert [r["local_experts"] for r in records] == [2, 2]
    if name == "tp_compile_warm":  # loaded from the on-disk cache the first compile filled, on every rank
        assert all(r["cache_hits"] >= 1 for r in records), records
    if name in ("sigmoid_shared_capacity", "tp_full"):
        assert records[0]["bias"] > 0  # the balancing bias moved, identically in both layouts


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_ep2_with_experts_fsdp_sharded_over_the_other_two_ranks(tmp_path, parity):
    """4 ranks, dp_shard = 4, ep = 2: each expert shard is FSDP-sharded over the 2 ranks that hold it, the
    rest over all 4; against plain data parallelism over the same 4 ranks."""
    check_parity(parity, run_cases(tmp_path, 4, {"fsdp4": CASES["fsdp"]})["fsdp4"], CASES["fsdp"])


def moe_model(**fields) -> Transformer:
    base = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16, num_experts=4, moe_top_k=2)
    return Transformer(ModelConfig(**{**base, **fields}))


@pytest.fixture
def ep_mesh_of_one():
    """A 1-rank process group: enough to reach the checks, which run before anything is sharded."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # in-memory: no port to race for
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(num_experts=3, moe_top_k=1), "not divisible by distributed.ep"),
        (dict(moe_packed_experts=False), "moe_packed_experts = true"),
        (dict(moe_gradient_scale=True), "moe_gradient_scale is not supported"),
        (dict(num_experts=0), "needs a mixture-of-experts model"),
    ],
)
def test_unsupported_layouts_are_user_errors(ep_mesh_of_one, monkeypatch, fields, message):
    model = moe_model(**fields)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(type(ep_mesh_of_one), "size", lambda self, dim=None: 2)  # checks see ep = 2
    with pytest.raises(UserError, match=message):
        apply_expert_parallel(model, ep_mesh_of_one)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing was touched


@pytest.mark.skipif(GROUPED_MM is None, reason="this torch has no grouped_mm")
@pytest.mark.parametrize("fields", [dict(), dict(moe_packed_experts=False, moe_gradient_scale=True)])
def test_loop_implementation_equals_grouped_in_the_module(fields, parity):
    """The MoE's two expert implementations (the loop one also serves ranks under EP): output and grads, in
    fp32 (grouped_mm has no float64 kernel) within parity.fp32_bound of the experts' three matmuls over at
    most the FFN width, forward and backward (depth 6), at each tensor's own scale."""
    torch.manual_seed(0)
    model = moe_model(n_layers=1, **fields)
    moe = model.layers["0"].feed_forward
    x = torch.randn(2, 8, 32)
    results = []
    for implementation in ("grouped", "loop"):
        moe.implementation = implementation
        out, _ = moe(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append([out.detach(), *(p.grad.clone() for p in moe.parameters())])
        moe.zero_grad()
    assert len(results[0]) == len(results[1]) > 1
    length = max(model.cfg.dim, model.cfg.ffn_dim)
    for index, (grouped, looped) in enumerate(zip(*results)):
        tol = fp32_bound(looped.abs().max().item(), length, depth=6)
        parity.close(grouped, looped, atol=tol, what="output" if index == 0 else f"gradient {index}")


def test_expert_parallel_hooks_the_experts_module_and_patches_no_method(ep_mesh_of_one):
    """On a 1-rank ep mesh the exchange is the identity: the model computes what it computes unsharded, through
    the hooks of the experts module, whose parameters are DTensors under their own names, while no instance
    attribute of an MoE layer or its experts shadows a method of their class."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    plain = moe_model(moe_shared_experts=1)
    torch.manual_seed(0)
    sharded = moe_model(moe_shared_experts=1)
    apply_expert_parallel(sharded, ep_mesh_of_one)
    tokens = torch.randint(0, 64, (2, 16))
    results = []
    for model in (plain, sharded):
        logits = model(tokens)
        (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
        grads = {
            k: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for k, p in model.named_parameters()
        }
        results.append((logits.detach(), grads))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1].keys() == results[1][1].keys()
    assert all(torch.equal(g, results[1][1][k]) for k, g in results[0][1].items())
    for block in sharded.layers.values():
        moe = block.feed_forward
        for module in (moe, moe.experts):
            methods = {name for name in dir(type(module)) if callable(getattr(type(module), name))}
            assert not methods & set(vars(module)), methods & set(vars(module))
        assert all(isinstance(p, DTensor) for p in moe.experts.parameters())
        assert moe.experts._forward_pre_hooks and moe.experts._forward_hooks


# The same layout as a user starts it (`forge train --nproc-per-node 2`), against plain data parallelism and one process.


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> tuple[list[str], Path]:
    """Short documents and one process's packed run on them (tests/helpers/layouts.short_documents)."""
    return layouts.short_documents(tmp_path_factory)


@pytest.mark.slow
def test_expert_parallel_matches_plain_data_parallel(tmp_path, parity):
    """ep = 2 (each rank holds half the experts, tokens exchanged all-to-all, experts and the rest under FSDP)
    computes what the same two ranks compute with every expert on each (ep = 1)."""
    runs = {ep: tmp_path / f"ep{ep}" for ep in (1, 2)}
    for ep, run_dir in runs.items():
        result = forge(run_dir, *MOE, f"--distributed.ep={ep}", nproc=2)
        assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(runs[2], runs[1], parity)
    assert any(key.startswith("moe/") for key in records(runs[2])[6])


@pytest.mark.slow
def test_expert_parallel_matches_one_process(tmp_path, short_documents, parity):
    """ep = 2 on two ranks (FSDP, dp_shard = 2) against one process on the same global batch, both on packed
    windows of short documents (so expert parallelism is checked with the document masks on), routing
    group-limited (DeepSeek-V3's node-limited choice: 2 groups of 2 experts, a token keeps the better one; each
    ep rank holds one group). Without the batch-level balance loss: each rank computes it over its own
    micro-batch, and the mean of two such losses is not the loss of their union (measured with
    moe_aux_loss_weight = 0.001: the step-6 loss 5.6e-5 away from one process's, with 0: every step within
    2e-6). The balancing bias still moves, on the router load summed over the ranks."""
    source, _ = short_documents
    grouped = ["--model.moe_n_group=2", "--model.moe_topk_group=1"]
    moe = [*MOE, *grouped, "--model.moe_aux_loss_weight=0", *source, "--data.pack_sequences=true"]
    result = forge(tmp_path / "ep2", *moe, "--distributed.ep=2", nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    result = forge(tmp_path / "single", *moe)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(tmp_path / "ep2", tmp_path / "single", parity)
    assert records(tmp_path / "single")[6]["moe/1/bias_max"] > 0
    routed = load_job_config(tmp_path / "ep2" / "config.toml").model
    assert (routed.moe_router, routed.moe_n_group, routed.moe_topk_group) == ("sigmoid_topk", 2, 1)
