"""The chunked cross-entropy under tensor parallelism (vocabulary-parallel: the head's shards are never gathered)
and under pipeline parallelism (on the last stage) equals one process's plain cross-entropy: the loss with
z-loss, every parameter's gradient, each token's loss and the per-source losses built from them, and the
evaluation loss without z-loss. One torchrun of 2 processes runs both layouts.

Tolerance: parity.FP64_TOL with float64 models. Both sides compute the same function (the chunked loss sums
the same terms in another order, across ranks under TP), so the claim is equality of algorithms, which the
project checks in float64 (tests/helpers/parity.py explains the bound).
"""

from __future__ import annotations

import json

from tests.helpers.parity import FP64_TOL
from tests.helpers.torchrun import torchrun

SCRIPT = """
import copy, json, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from engine.config.model import ModelConfig
from engine.config.train import TrainConfig
from engine.model.transformer import Transformer
from engine.parallel.launch import join_process_group, end_process
from engine.parallel.pipeline import StageShapes, build_pipeline
from engine.parallel.tp import apply_tensor_parallel, uses_loss_parallel
from engine.train.losses import StageCrossEntropy, build_loss, cross_entropy
from engine.train.source_losses import SourceLosses

out = sys.argv[1]
join_process_group("gloo", 300, torch.device("cpu"))
torch.set_default_dtype(torch.float64)
rank, cpu = dist.get_rank(), torch.device("cpu")
BATCH, SEQ, VOCAB, CHUNK, Z = 4, 16, 63, 24, 1e-2  # 63 rows shard unevenly (32 + 31); 64 tokens in chunks of 24
g = torch.Generator().manual_seed(0)
data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
tokens, labels = data[:, :-1], data[:, 1:]
sources = torch.tensor([0, 1, 1, 0])  # each row's source, as a mixture's batches carry them


class Shapes(TorchDispatchMode):
    # the shapes of every plain tensor an op makes (DTensor ops show their global shapes: left out)
    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if isinstance(result, torch.Tensor) and not isinstance(result, DTensor):
            self.seen.add(tuple(result.shape))
        return result


def reference(cfg):
    # one process, the plain loss on the whole batch: loss, per-token losses, gradients by name, eval loss
    torch.manual_seed(0)
    model = Transformer(cfg)
    base = copy.deepcopy(model)
    kept = []
    loss = cross_entropy(model(tokens), labels, Z, kept.append)
    loss.backward()
    with torch.no_grad():
        evaluated = cross_entropy(model(tokens), labels).item()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return base, loss.item(), kept[0], grads, evaluated


def per_source(token_losses):
    tally = SourceLosses(("a", "b"), cpu)
    if token_losses is not None:
        tally.add(token_losses, sources)
    return tally.metrics()  # a collective: every rank calls it


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


res = {}
# --- tensor parallelism, tp = 2: the trainer's chunked loss on the TP model
cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=SEQ)
base, ref_loss, ref_tokens, ref_grads, ref_eval = reference(cfg)
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
model = copy.deepcopy(base)
apply_tensor_parallel(model, mesh["tp"], loss_parallel=uses_loss_parallel(2, "chunked_cross_entropy"))
loss_fn = build_loss(TrainConfig(loss_fn="chunked_cross_entropy", ce_chunk_size=CHUNK, z_loss_weight=Z))
kept = []
with Shapes() as shapes:
    loss = loss_fn(model, tokens, labels, on_token_losses=kept.append)
    loss.backward()
with torch.no_grad():
    evaluated = loss_fn(model, tokens, labels, z_loss=False)
grads = {n: full(p.grad) for n, p in model.named_parameters()}
res["tp"] = {
    "loss": abs(loss.item() - ref_loss),
    "eval": abs(evaluated.item() - ref_eval),
    "eval_vs_training": abs(evaluated.item() - ref_loss),
    "tokens": (kept[0] - ref_tokens).abs().max().item(),
    "grads": {n: (grads[n] - g).abs().max().item() for n, g in ref_grads.items()},
    "names": sorted(grads) == sorted(ref_grads),
    "head_placement": str(model.output.weight.placements),
    "two_dim": [s for s in shapes.seen if len(s) == 2],
    "vocab_sized": [s for s in shapes.seen if VOCAB in s],
    "sources": [per_source(kept[0]), per_source(ref_tokens)],
}

# --- pipeline parallelism, pp = 2 (1F1B, 2 micro-batches), tied embeddings: the chunked loss on the last stage
cfg = ModelConfig(dim=32, n_layers=4, n_heads=4, vocab_size=VOCAB, max_seq_len=SEQ, tie_embeddings=True)
base, ref_loss, ref_tokens, ref_grads, ref_eval = reference(cfg)
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
stage_loss = StageCrossEntropy(Z, CHUNK)
shapes = StageShapes(BATCH // 2, SEQ, SEQ, 32, VOCAB, torch.float64, torch.float64, last_hidden=True)
pipe = build_pipeline(copy.deepcopy(base), mesh["pp"], "1f1b", 2, stage_loss, cpu, shapes)
if pipe.has_last_stage:
    stage_loss.bind_head(pipe.model_parts[0].output)
with stage_loss.recording() as token_losses:
    loss = pipe.step_loss(pipe.step(tokens, labels), cpu)
grads = {n: p.grad.clone() for part in pipe.model_parts for n, p in part.named_parameters()}
with stage_loss.plain():
    evaluated = pipe.step_loss(pipe.evaluate(tokens, labels), cpu)
TIED = {"output.weight": "tok_embeddings.weight"}
mine = torch.cat(token_losses[-2:]) if pipe.has_last_stage else None
res["pp"] = {
    "loss": abs(loss.item() - ref_loss),
    "eval": abs(evaluated.item() - ref_eval),
    "eval_vs_training": abs(evaluated.item() - ref_loss),
    "tokens": None if mine is None else (mine - ref_tokens).abs().max().item(),
    # the last stage's head is its copy of the tied matrix: after the step it holds the one gradient of both uses
    "grads": {n: (g - ref_grads[TIED.get(n, n)]).abs().max().item() for n, g in grads.items()},
    "last_stage": pipe.has_last_stage,
    "sources": [per_source(mine), per_source(ref_tokens)],
}
gathered = [None, None]
dist.all_gather_object(gathered, res)
if rank == 0:
    open(out, "w").write(json.dumps(gathered))
dist.barrier()
dist.destroy_process_group()
end_process(0)
"""


def test_chunked_loss_under_tp_and_pp_matches_one_process_plain_loss(tmp_path, parity):
    script, out = tmp_path / "chunked_parallel.py", tmp_path / "result.json"
    script.write_text(SCRIPT)
    result = torchrun(script, 2, str(out), timeout=180)
    assert result.returncode == 0, result.stdout[-4000:]
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for rank, res in enumerate(ranks):
        tp, pp = res["tp"], res["pp"]
        # tensor parallelism: vocabulary-parallel, never a [*, 63] or [63, *] plain tensor (logits or head)
        assert tp["head_placement"] == "(Shard(dim=0),)"
        assert tp["vocab_sized"] == [], tp["vocab_sized"]
        # this rank's logits of each chunk (24, 24, then 16 tokens) over its own 32 or 31 rows of the vocabulary
        assert {(24, 32 - rank), (16, 32 - rank)} <= set(map(tuple, tp["two_dim"])), tp["two_dim"]
        assert tp["names"] and len(tp["grads"]) == 1 + 2 * 9 + 2  # embedding, 2 blocks of 9, norm, head
        # pipeline: rank 1 holds the last stage (its head, the tied copy of the embedding)
        assert pp["last_stage"] == (rank == 1)
        # 4 blocks of 9 parameters: the embedding and 2 on rank 0, 2 with the norm and the head on rank 1
        assert len(pp["grads"]) == (19 if rank == 0 else 20), sorted(pp["grads"])
        for name, row in (("tp", tp), ("pp", pp)):
            parity.within(f"rank {rank} {name} loss", row["loss"], FP64_TOL)
            parity.within(f"rank {rank} {name} eval loss", row["eval"], FP64_TOL)
            assert row["eval_vs_training"] > 1e-3, "z-loss is in the training loss and not in the eval loss"
            worst = max(row["grads"], key=row["grads"].get)
            parity.within(f"rank {rank} {name} gradients (worst: {worst})", row["grads"][worst], FP64_TOL)
            ours, theirs = row["sources"]
            assert sorted(ours) == sorted(theirs) == ["loss/a", "loss/b"]
            for key in ours:
                parity.within(f"rank {rank} {name} {key}", abs(ours[key] - theirs[key]), FP64_TOL)
        parity.within(f"rank {rank} tp token losses", tp["tokens"], FP64_TOL)
        if rank == 1:
            parity.within("pp token losses", pp["tokens"], FP64_TOL)
