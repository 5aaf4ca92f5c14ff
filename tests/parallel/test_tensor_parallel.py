"""Tensor + sequence parallelism (engine.parallel.tp) trains exactly like one process.

Every process builds the same seeded model, keeps one copy as the single-process reference and applies TP
(and, on a dp × tp mesh, FSDP2) to the other; both take the same AdamW steps with gradient clipping. The
per-step losses, the clipped gradient norms and the final full weights must agree to parity.FP64_TOL: the
models are float64, since the claim is that both compute the same function (see tests/helpers/parity.py). In the
`*_compiled` cases both models' blocks are compiled (train.compile_model), and dynamo's counters must show it.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.parity import FP64_TOL
from tests.helpers.torchrun import torchrun

PARITY_SCRIPT = """
import copy, json, sys
import torch, torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from engine.config.model import ModelConfig
from engine.config.optimizer import OptimizerConfig
from engine.config.train import TrainConfig
from engine.model.transformer import Transformer
from engine.parallel.apply import apply_compile
from engine.parallel.tp import apply_tensor_parallel, loss_context, uses_loss_parallel
from engine.train.losses import build_loss, mtp_metrics
from engine.train.optim import build_optimizer

from engine.parallel.launch import join_process_group

out, model_args, train_args = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
join_process_group("gloo", 300, torch.device("cpu"))  # as forge: a compile cache for this rank alone
torch.set_default_dtype(torch.float64)
dp = dist.get_world_size() // 2
mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
cfg = ModelConfig(**{"dim": 32, "n_layers": 2, "n_heads": 4, "vocab_size": 64, "max_seq_len": 16, **model_args})
train_cfg = TrainConfig(**train_args)
loss_fn, parallel_loss = build_loss(train_cfg), uses_loss_parallel(2, train_cfg.loss_fn)

torch.manual_seed(0)
ref = Transformer(cfg)
init = [p.detach().clone() for p in ref.parameters()]
model = copy.deepcopy(ref)
apply_tensor_parallel(model, mesh["tp"], loss_parallel=parallel_loss)
assert not cfg.tie_embeddings or model.output.weight is model.tok_embeddings.weight
if train_cfg.compile_model:  # both models' blocks, where engine.parallel.apply compiles them: after TP, before FSDP
    apply_compile(ref)
    apply_compile(model)
if dp > 1:
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
# A small lr: Adam's first steps are ~lr·sign(grad), so rounding-level gradient differences on near-zero
# entries would show up as lr-sized weight differences.
ref_opt, opt = (build_optimizer(m, OptimizerConfig(lr=1e-3)) for m in (ref, model))


def full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


rows = slice(mesh["dp"].get_local_rank() * 4 // dp, (mesh["dp"].get_local_rank() + 1) * 4 // dp)
res = {"ref_loss": [], "loss": [], "ref_norm": [], "norm": [], "ref_mtp": [], "mtp": []}
for step in range(5):
    batch = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(step))
    tokens, labels = batch[:, :-1], batch[:, 1:]
    ref_loss = loss_fn(ref, tokens, labels)
    ref_loss.backward()
    res["ref_norm"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item())
    ref_opt.step(); ref_opt.zero_grad()
    with loss_context(parallel_loss):  # every TP rank gets its dp rank's whole batch
        loss = loss_fn(model, tokens[rows], labels[rows])
        loss.backward()
    res["norm"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())  # a Replicate DTensor
    opt.step(); opt.zero_grad()
    loss = full(loss)
    dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
    res["ref_loss"].append(ref_loss.item()); res["loss"].append(loss.item())
    if cfg.mtp_depth:  # the main and each depth's loss, as the trainer logs them (averaged over dp)
        res["ref_mtp"].append(mtp_metrics(ref)); res["mtp"].append(mtp_metrics(model, mesh["dp"].get_group()))
res["weight_error"] = {name: (full(p) - q.detach()).abs().max().item()
                       for (name, p), q in zip(model.named_parameters(), ref.parameters())}
res["moved"] = max((q.detach() - p0).abs().max().item() for q, p0 in zip(ref.parameters(), init))
# Compiled graphs ran: dynamo compiled frames (fullgraph: no graph breaks) and AOTAutograd built their backwards.
res["compiled"] = {"frames": counters["stats"]["unique_graphs"], "aot_autograd": counters["aot_autograd"]["total"]}
res["tp_placement"] = {name: str(p.placements[-1]) for name, p in model.named_parameters()}  # tp: last mesh dim
if dist.get_rank() == 0:
    (__import__("pathlib").Path(out) / "result.json").write_text(json.dumps(res))
dist.barrier()
dist.destroy_process_group()
from engine.parallel.launch import end_process
end_process(0)  # leave without interpreter teardown while gloo's threads live (see end_process)
"""

CASES = {
    # Vocabulary-sharded logits through loss_parallel(), z-loss included. Both models' blocks compiled
    # (compile_model), and in chunked_tied too: the embedding, the head and the loss around them run eagerly.
    "loss_parallel_compiled": (2, {}, {"loss_fn": "cross_entropy", "z_loss_weight": 1e-3, "compile_model": True}),
    # Chunked CE projects through the full head itself; with tied embeddings that head is the embedding.
    "chunked_tied_compiled": (
        2,
        {"tie_embeddings": True, "qk_norm": True},
        {"loss_fn": "chunked_cross_entropy", "ce_chunk_size": 24, "z_loss_weight": 1e-3, "compile_model": True},
    ),
    # GQA splits query and key/value heads in the same groups; QK-norm sees head-sharded tensors; 63 rows of
    # vocabulary shard unevenly. With two multi-token-prediction modules (engine/model/mtp.py) on the
    # sequence-sharded stream, their logits vocabulary-sharded through the tied head (loss parallel).
    "gqa_qk_norm_tied_mtp": (
        2,
        {"n_kv_heads": 2, "qk_norm": True, "tie_embeddings": True, "vocab_size": 63, "mtp_depth": 2},
        {"loss_fn": "cross_entropy"},
    ),
    # FSDP2 over dp composes with TP on a 2 × 2 mesh; each dp rank trains on half the batch. A prediction
    # module's loss through the chunked, vocabulary-parallel head loss (engine/train/losses.head_cross_entropy).
    "fsdp_dp2_tp2_chunked_mtp": (
        4,
        {"n_kv_heads": 2, "norm_type": "layernorm", "mtp_depth": 1, "mtp_loss_weight": 0.5},
        {"loss_fn": "chunked_cross_entropy", "ce_chunk_size": 24, "z_loss_weight": 1e-3},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tensor_parallel_matches_one_process(tmp_path, case, parity):
    nproc, model_args, train_args = CASES[case]
    script = tmp_path / "tp_parity.py"
    script.write_text(PARITY_SCRIPT)
    result = torchrun(script, nproc, str(tmp_path), json.dumps(model_args), json.dumps(train_args), timeout=180)
    assert result.returncode == 0, result.stdout[-4000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert len(res["loss"]) == len(res["ref_loss"]) == len(res["norm"]) == len(res["ref_norm"]) == 5
    parity.within("losses", max(abs(a - b) for a, b in zip(res["loss"], res["ref_loss"])), FP64_TOL)
    depth = model_args.get("mtp_depth", 0)
    assert len(res["mtp"]) == len(res["ref_mtp"]) == (5 if depth else 0)
    for step, (ours, ref) in enumerate(zip(res["mtp"], res["ref_mtp"]), 1):
        assert sorted(ours) == sorted(ref) == ["loss_main", *(f"mtp/loss_{k}" for k in range(1, depth + 1))]
        parity.within(f"main and depth losses step {step}", max(abs(ours[k] - ref[k]) for k in ref), FP64_TOL)
    parity.within("grad norms", max(abs(a - b) for a, b in zip(res["norm"], res["ref_norm"])), FP64_TOL)
    assert max(res["ref_norm"]) > 0.5, "clipping should have been active"
    worst = max(res["weight_error"], key=res["weight_error"].get)
    parity.within(f"weights (worst: {worst})", res["weight_error"][worst], FP64_TOL)
    assert res["moved"] > 1e-3, "the weights should have changed far more than the tolerance"
    # Compiled: one graph for the one-process blocks and one for the DTensor blocks (every block reuses its
    # model's), each with its backward; a recompile per block would show here.
    expected = 2 if train_args.get("compile_model", False) else 0
    assert res["compiled"]["frames"] == res["compiled"]["aot_autograd"] == expected, res["compiled"]
    placement = res["tp_placement"]
    assert placement["layers.0.attention.wq.weight"] == placement["tok_embeddings.weight"] == "S(0)"
    assert placement["layers.0.attention.wo.weight"] == "S(1)"
    assert placement["norm.weight"] == "R"
    if model_args.get("mtp_depth"):  # the prediction modules' projection and block are sharded too
        assert placement["mtp.1.proj.weight"] == placement["mtp.1.block.attention.wq.weight"] == "S(0)"
        assert placement["mtp.1.block.feed_forward.w2.weight"] == "S(1)" and placement["mtp.1.norm.weight"] == "R"
