"""The GPT-2 family under FSDP, tensor, context and pipeline parallelism trains like one process.

One launch of 2 gloo processes runs every layout in turn: each rank builds the same seeded GPT-2 (tied head,
biases, learned positions), keeps one copy as the one-process reference and lays the other out through the
engine (`engine.parallel.apply.parallelize` on the engine's mesh; `build_pipeline` for two stages), and both
take the same AdamW steps on the same global batch: FSDP on half the rows per rank, TP on all of them with
loss parallel (both embeddings are vocabulary-style lookups: tok rows, position rows), CP on each rank's
head-tail slice of every sequence (the position embedding looked up at the positions the rank holds), PP in
two micro-batches; ulysses and the activation-checkpointed layouts recompute through the same hooks. The
models are float64, since the claim is that the layouts compute the same function:
per-step losses and final full weights agree to parity.FP64_TOL (tests/helpers/parity.py derives it; a lost
reduction, a wrong position or a bias added twice moves a loss by > 1e-4).
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.parity import FP64_TOL
from tests.helpers.torchrun import torchrun

pytestmark = pytest.mark.slow

SCRIPT = """
import copy, json, sys
import torch, torch.distributed as dist
from torch.distributed.tensor import DTensor
from engine.config import load_job_config
from engine.plan import check_config
from engine.model import build_model
from engine.parallel.apply import parallelize
from engine.parallel.context import ContextParallel
from engine.parallel.mesh import ParallelDims, build_mesh
from engine.parallel.pipeline import StageShapes, build_pipeline
from engine.parallel.tp import loss_context, uses_loss_parallel
from engine.train.losses import StageCrossEntropy, build_loss
from engine.train.optim import build_optimizer

out, cases = sys.argv[1], json.loads(sys.argv[2])
dist.init_process_group("gloo")
torch.set_default_dtype(torch.float64)  # every model below; mixed_precision=fp32 casts nothing
TINY = ["--model.model_type=gpt2", "--model.dim=32", "--model.n_layers=2", "--model.n_heads=4",
        "--model.vocab_size=64", "--model.max_seq_len=16", "--model.tie_embeddings=true", "--train.seq_len=16",
        "--train.batch_size=2", "--optimizer.lr=1e-3", "--train.mixed_precision=fp32",
        "--train.loss_fn=cross_entropy"]
cpu, rank, world = torch.device("cpu"), dist.get_rank(), dist.get_world_size()


def full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def randomized(model):
    # biases and LayerNorms away from 0 and 1, so that a bias added twice or a norm sharded wrongly shows
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model


results = {}
for name, overrides in cases.items():
    cfg = check_config(load_job_config(None, TINY + overrides), world)
    dims = ParallelDims.from_config(cfg.distributed, world)
    mesh = build_mesh(dims, "cpu")
    torch.manual_seed(0)
    ref = randomized(build_model(cfg.model))
    loss_fn = build_loss(cfg.train)
    if dims.pp > 1:
        shapes = StageShapes(2, 16, 16, 32, 64, torch.float64, torch.float64)
        pipe = build_pipeline(copy.deepcopy(ref), mesh.get("pp"), "1f1b", 2, StageCrossEntropy(0.0), cpu, shapes)
        parts = pipe.model_parts
    else:
        parts = [parallelize(copy.deepcopy(ref), cfg, mesh, device=cpu)]
    parallel_loss = uses_loss_parallel(dims.tp, cfg.train.loss_fn, dims.pp)
    ref_opt = build_optimizer(ref, cfg.optimizer)
    opt = build_optimizer(parts[0], cfg.optimizer)
    shard = ContextParallel(mesh.get("cp")).shard if dims.cp > 1 else (lambda t: t)
    rows = slice(mesh.dp_rank * 4 // dims.dp, (mesh.dp_rank + 1) * 4 // dims.dp)
    res = {"ref_loss": [], "loss": []}
    for step in range(3):
        batch = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(step))
        tokens, labels = batch[:, :-1], batch[:, 1:]
        ref_loss = loss_fn(ref, tokens, labels)
        ref_loss.backward()
        ref_opt.step(); ref_opt.zero_grad()
        if dims.pp > 1:
            loss = pipe.step_loss(pipe.step(tokens, labels), cpu)
        else:
            with loss_context(parallel_loss):
                loss = loss_fn(parts[0], shard(tokens[rows]), shard(labels[rows]))
                loss.backward()
            loss = full(loss).clone()
            dist.all_reduce(loss)
            loss = loss / world
        opt.step(); opt.zero_grad()
        res["ref_loss"].append(ref_loss.item()); res["loss"].append(loss.item())
    expected = dict(ref.named_parameters())
    same = {"output.weight": "tok_embeddings.weight"}  # the last stage's copy of the tied matrix
    plain = (n.replace("._checkpoint_wrapped_module", "") for part in parts for n, _ in part.named_parameters())
    params = (p for part in parts for p in part.parameters())
    held = {same.get(n, n): p for n, p in zip(plain, params)}
    res["weights"] = sorted(held)
    res["weight_error"] = max((full(p) - expected[n].detach()).abs().max().item() for n, p in held.items())
    res["sharded"] = all(isinstance(p, DTensor) for p in parts[0].parameters())
    results[name] = res
(__import__("pathlib").Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
dist.barrier()
dist.destroy_process_group()
from engine.parallel.launch import end_process
end_process(0)
"""

LAYOUTS = {
    "fsdp": ["--distributed.dp_shard=2"],
    "tp": ["--distributed.tp=2", "--distributed.dp_shard=1"],
    "cp_allgather": ["--distributed.cp=2", "--distributed.dp_shard=1", "--distributed.cp_method=allgather"],
    "cp_ring": ["--distributed.cp=2", "--distributed.dp_shard=1", "--distributed.cp_method=ring"],
    # ulysses moves heads, not positions, across the ranks; recomputation reruns its all-to-alls in backward
    "cp_ulysses_full_ac": [
        "--distributed.cp=2",
        "--distributed.dp_shard=1",
        "--distributed.cp_method=ulysses",
        "--train.activation_checkpointing=full",
    ],
    "tp_selective_ac": ["--distributed.tp=2", "--distributed.dp_shard=1", "--train.activation_checkpointing=selective"],
    "pp": ["--distributed.pp=2", "--distributed.dp_shard=1", "--train.grad_accum_steps=2"],
}


def test_gpt2_layouts_train_like_one_process(tmp_path, parity):
    script = tmp_path / "gpt2_layouts.py"
    script.write_text(SCRIPT)
    done = torchrun(script, 2, str(tmp_path), json.dumps(LAYOUTS))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert all(sorted(r) == sorted(LAYOUTS) for r in ranks)
    names = None
    for rank, result in enumerate(ranks):
        for layout, res in result.items():
            assert len(res["loss"]) == len(res["ref_loss"]) == 3
            worst = max(abs(a - b) for a, b in zip(res["loss"], res["ref_loss"]))
            parity.within(f"{layout} rank {rank} losses", worst, FP64_TOL)
            parity.within(f"{layout} rank {rank} weights", res["weight_error"], FP64_TOL)
            if layout != "pp":
                names = names or res["weights"]
                assert res["weights"] == names and len(names) == 2 + 2 * 16 + 2 and res["sharded"], (layout, rank)
    # the pipeline ranks hold the model between them: the embeddings and first block on one, the rest on the other
    stages = [set(r["pp"]["weights"]) for r in ranks]
    assert stages[0] | stages[1] == set(names) and "pos_embeddings.weight" in stages[0] - stages[1]
    assert "norm.bias" in stages[1] - stages[0]
    # and the steps moved the loss: a layout that did nothing would not match the reference's path
    assert ranks[0]["fsdp"]["ref_loss"][2] != ranks[0]["fsdp"]["ref_loss"][0]
