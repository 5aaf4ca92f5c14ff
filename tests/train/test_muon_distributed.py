"""Distributed Muon (issue 52, part 1: engine/train/optim/muon_distributed.py): each hidden matrix of a step is
orthogonalized once in the job, by its owner, under FSDP 2 and 4, HSDP 2×2, TP 2 and FSDP 2 × TP 2, with the
same weights as one process (float64, within parity.FP64_TOL: the claim is that both compute the same function)
and a Newton–Schulz share per rank (torch's FLOP counter) of at most total / N plus the largest matrix, where
every rank used to do the total."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.train.optim.muon_distributed import assign_owners, newton_schulz_flops
from tests.helpers.parity import FP64_TOL
from tests.helpers.torchrun import torchrun

SCRIPT = """
import copy, json, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import FlopCounterMode
from engine.config.model import ModelConfig
from engine.config.optimizer import OptimizerConfig
from engine.model.transformer import Transformer
from engine.parallel.apply import apply_fsdp
from engine.parallel.tp import apply_tensor_parallel
from engine.train.losses import cross_entropy
from engine.train.optim import build_optimizer
from engine.train.optim.groups import hidden_matrices
from engine.train.optim.muon_distributed import newton_schulz_flops

out = sys.argv[1]
dist.init_process_group("gloo")
torch.set_default_dtype(torch.float64)  # one function computed two ways: compared to parity.FP64_TOL
rank = dist.get_rank()
# uneven shards on purpose: wk/wv have 12 rows, the MLP 88 (not multiples of 8); lr large enough to move weights
cfg = ModelConfig(dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16, ffn_hidden_dim=44)
opt_cfg = OptimizerConfig.model_validate({"name": "muon", "lr": 0.02, "weight_decay": 0.1})
STEPS, BATCH = 3, 4
NS_STEPS = opt_cfg.muon_ns_steps


def batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        data = torch.randint(0, cfg.vocab_size, (BATCH, cfg.max_seq_len + 1), generator=g)
        yield data[:, :-1], data[:, 1:]


def full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def train(model, rows=slice(None), reduce=None):
    # FSDP: each data-parallel rank takes its rows of the batch; the gradients are averaged (and so the losses).
    opt, flops = build_optimizer(model, opt_cfg), []
    for x, y in batches():
        loss = cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        with FlopCounterMode(display=False) as counter:
            opt.step()
        opt.zero_grad()
        flops.append(counter.get_total_flops())
    return flops, {n: full(p) for n, p in model.named_parameters()}


torch.manual_seed(0)
base = Transformer(cfg)
shapes = [tuple(p.shape) for p in hidden_matrices(base)]
total = sum(newton_schulz_flops(s, NS_STEPS) for s in shapes)
largest = max(newton_schulz_flops(s, NS_STEPS) for s in shapes)
reference = train(copy.deepcopy(base))
results = {}
# (mesh shape, names): FSDP over dim "dp_shard", HSDP over both dp dims, TP over "tp"; a layout on a 2-rank
# sub-mesh runs twice side by side (each pair of ranks trains the whole model on the whole batch)
layouts = {
    "fsdp2": ((2, 2), ("copy", "dp_shard")),
    "fsdp4": ((4,), ("dp_shard",)),
    "hsdp2x2": ((2, 2), ("dp_replicate", "dp_shard")),
    "tp2": ((2, 2), ("copy", "tp")),
    "fsdp2_tp2": ((2, 2), ("dp_shard", "tp")),
}
for name, (shape, names) in layouts.items():
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = copy.deepcopy(base)
    if "tp" in names:
        apply_tensor_parallel(model, mesh["tp"], loss_parallel=False)
    dp = [n for n in names if n.startswith("dp_")]
    rows, reduce, ranks = slice(None), None, 1
    if dp:
        dp_mesh = mesh[tuple(dp)] if len(dp) > 1 else mesh[dp[0]]
        apply_fsdp(model, dp_mesh, torch.float32)  # fp32 "compute": casts nothing, the model stays float64
        ranks = dp_mesh.size()
        index = dp_mesh.get_local_rank() if len(dp) == 1 else dp_mesh["dp_replicate"].get_local_rank() * 2 + dp_mesh["dp_shard"].get_local_rank()
        per = BATCH // ranks
        rows = slice(index * per, (index + 1) * per)
    flops, weights = train(model, rows)
    group = 1
    for n in names:
        if n != "copy":
            group *= mesh[n].size()
    results[name] = {
        "flops": flops,
        "group": group,
        "weights": max((weights[n] - w).abs().max().item() for n, w in reference[1].items()),
        "worst": max(reference[1], key=lambda n: (weights[n] - reference[1][n]).abs().max().item()),
        "same_names": sorted(weights) == sorted(reference[1]),
    }
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, results)
if rank == 0:
    report = {"total": total, "largest": largest, "reference_flops": reference[0], "ranks": gathered}
    (__import__("pathlib").Path(out) / "result.json").write_text(json.dumps(report))
dist.barrier()
dist.destroy_process_group()
from engine.parallel.launch import end_process
end_process(0)
"""

LAYOUTS = ("fsdp2", "fsdp4", "hsdp2x2", "tp2", "fsdp2_tp2")


def test_each_matrix_is_orthogonalized_once_and_the_weights_are_one_process(tmp_path, parity):
    """One launch of 4 gloo ranks, float64, 3 Muon steps (weight decay on) under each layout: every weight
    equals one process's within FP64_TOL; per step, the Newton–Schulz FLOPs of the ranks of one mesh add up
    to the job's total once (one process does all of it) and none does more than total / N + the largest."""
    script = tmp_path / "muon_layouts.py"
    script.write_text(SCRIPT)
    result = torchrun(script, 4, str(tmp_path), timeout=400)
    assert result.returncode == 0, result.stdout[-4000:]
    report = json.loads((tmp_path / "result.json").read_text())
    total, largest = report["total"], report["largest"]
    assert report["reference_flops"] == [total] * 3
    for layout in LAYOUTS:
        rows = [ranks[layout] for ranks in report["ranks"]]
        n = rows[0]["group"]
        for rank, row in enumerate(rows):
            assert row["same_names"], layout
            parity.within(f"{layout} rank {rank} weights (worst: {row['worst']})", row["weights"], FP64_TOL)
            assert all(f <= total / n + largest for f in row["flops"]), (layout, rank, row["flops"], total / n)
        # the ranks of one mesh share the total exactly once: 4 ranks hold 4 / n copies of the job's work
        assert [sum(row["flops"][step] for row in rows) for step in range(3)] == [total * 4 // n] * 3, layout
        assert n in (2, 4)


@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_owners_share_the_work_within_grahams_bound(ranks):
    """Largest first to the least loaded rank: each rank's load is at most total / N + the largest cost,
    and the assignment depends only on the list (the same on every rank)."""
    shapes = [(64, 64), (16, 64), (16, 64), (64, 64), (172, 64), (172, 64), (64, 172), (8, 8), (64, 64)]
    costs = [newton_schulz_flops(s, 5) for s in shapes]
    owners = assign_owners(costs, ranks)
    load = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(ranks)]
    assert sum(load) == sum(costs) and max(load) <= sum(costs) / ranks + max(costs)
    assert owners == assign_owners(list(costs), ranks) and set(owners) <= set(range(ranks))


def test_newton_schulz_flops_are_what_torch_counts():
    from torch.utils.flop_counter import FlopCounterMode

    from engine.train.optim.muon import orthogonalize

    for shape in [(12, 40), (40, 12), (16, 16)]:
        with FlopCounterMode(display=False) as counter:
            orthogonalize(torch.randn(*shape), 5)
        assert counter.get_total_flops() == newton_schulz_flops(shape, 5)


def test_a_muon_run_resumes_bitwise_and_in_another_layout(tmp_path, parity):
    """`forge train --optimizer.name=muon` on 2 processes (FSDP), as a user types it: stopped at step 3 and
    resumed on 2 processes it logs the uninterrupted run's losses bitwise (the momentum buffers are sharded DCP
    state); resumed from the same checkpoint on one process, where each matrix is orthogonalized locally,
    steps 4-6 stay within the layouts' fp32 tolerance of it (tests/helpers/parity.TrainingTolerance)."""
    from tests.helpers.layouts import forge, records, tolerance

    muon = ["--optimizer.name=muon", "--optimizer.lr=0.01"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert forge(whole, *muon, nproc=2).returncode == 0
    result = forge(parts, *muon, "--train.max_steps=3", nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.copytree(parts, tmp_path / "other")
    result = forge(parts, *muon, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]

    def logged(run):
        return {step: (r["loss"], r["grad_norm"]) for step, r in records(run).items()}

    assert logged(parts) == logged(whole) and sorted(logged(whole)) == list(range(1, 7))
    result = forge(tmp_path / "other", *muon)  # the same global batch on one process
    assert result.returncode == 0, result.stderr[-3000:]
    tol, other = tolerance(whole), records(tmp_path / "other")
    for step in (4, 5, 6):
        parity.within(f"loss step {step}", abs(other[step]["loss"] - records(whole)[step]["loss"]), tol.loss_at(step))


MUON = ["--optimizer.name=muon", "--optimizer.lr=0.01"]


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("pp2", id="pp2"),  # each stage's optimizer holds its own matrices: plain tensors, local
        pytest.param("ep2", id="ep2"),  # the dense matrices FSDP-sharded over both ranks, the experts by ep
    ],
)
def test_muon_under_pipeline_and_expert_parallelism_trains_as_one_process(tmp_path, layout, parity):
    """`forge train --optimizer.name=muon` under pp = 2 and under ep = 2 (the MoE model), 2 processes, logs one
    process's per-step losses and gradient norms within the layouts' fp32 tolerances (TrainingTolerance)."""
    from tests.helpers.layouts import MOE, PIPELINE, forge, records, tolerance

    args, batch = ([*MUON, *PIPELINE], {"batch_size": 4}) if layout == "pp2" else ([*MUON, *MOE], {})
    one, two = tmp_path / "one", tmp_path / "two"
    single_args = [a for a in args if not a.startswith("--distributed.")]
    assert forge(one, *single_args).returncode == 0
    result = forge(two, *args, *(["--distributed.ep=2"] if layout == "ep2" else []), nproc=2, **batch)
    assert result.returncode == 0, result.stderr[-3000:]
    ours, ref, tol = records(two), records(one), tolerance(one)
    assert sorted(ours) == sorted(ref) == list(range(1, 7))
    for step in ref:
        parity.within(f"{layout} loss step {step}", abs(ours[step]["loss"] - ref[step]["loss"]), tol.loss_at(step))
        gap = abs(ours[step]["grad_norm"] / ref[step]["grad_norm"] - 1)
        parity.within(f"{layout} grad norm step {step}", gap, tol.norm_at(step))
