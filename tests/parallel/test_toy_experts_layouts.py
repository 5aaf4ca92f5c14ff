"""A model that is not Forge's transformer (tests/helpers/toy_experts_family.py: its own attention core, routed
experts and names) gets context and expert parallelism and FSDP through the modules its `ModelParts` declares,
with nothing in engine/ edited for it.

Parity (float64, where the claim is that a layout computes the same function): every process builds the same
seeded toy, keeps one copy as the one-process reference and lays the other out; one step's loss and every
gradient must agree to parity.FP64_TOL.
- context parallelism (each cp_method): the cp copy runs on its head-tail slice of every sequence (its positions
  passed by the hook to the toy's position embedding); the mean of the ranks' losses is the reference's, and so
  is the mean of their gradients (what FSDP's reduction over the cp ranks computes in training);
- expert parallelism over 2 data-parallel ranks, each on its own rows: a rank's loss is the reference's on those
  rows; the reference's gradient (of the mean of both ranks' losses) is each expert shard's local gradient (the
  exchange scales it by 1/ep) and the mean over the ranks of every other gradient.
Training: `engine.train.trainer.train` on 2 processes under FSDP, and under FSDP with ep = 2; under FSDP, killed
after step 5 and started again, to the uninterrupted run's losses and weights, bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.parity import FP64_TOL
from tests.helpers.torchrun import REPO, torchrun

PARITY_SCRIPT = """
import copy, json, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, sys.argv[2])
from tests.helpers import toy_experts_family as toy
toy.register()
from engine.parallel.context import ContextParallel, apply_context_parallel
from engine.parallel.expert import apply_expert_parallel
from engine.parallel.launch import end_process
from engine.train.losses import cross_entropy

dist.init_process_group("gloo")
torch.set_default_dtype(torch.float64)
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
cfg = toy.toy_config()
batch = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len + 1), generator=torch.Generator().manual_seed(1))
tokens, labels = batch[:, :-1], batch[:, 1:]


def loss_of(model, x, y):
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def mean_over_ranks(t):
    t = t.detach().clone()
    dist.all_reduce(t)
    return t / world


results = {}
torch.manual_seed(0)
ref = toy.ToyExpertsLM(cfg)
ref_loss = loss_of(ref, tokens, labels)
ref_loss.backward()
reference = {n: p.grad.detach() for n, p in ref.named_parameters()}

for method in ("allgather", "ring", "ulysses"):
    model = copy.deepcopy(ref)
    model.zero_grad()
    apply_context_parallel(model, mesh, method, torch.device("cpu"))
    cp = ContextParallel(mesh)
    loss = loss_of(model, cp.shard(tokens), cp.shard(labels))
    loss.backward()
    core = type(model.blocks["0"].mixer.core).__name__
    grads = {n: (mean_over_ranks(p.grad) - reference[n]).abs().max().item() for n, p in model.named_parameters()}
    results[method] = {"core": core, "loss": abs(mean_over_ranks(loss).item() - ref_loss.item()), "grad": max(grads.values())}

model = copy.deepcopy(ref)
model.zero_grad()
apply_expert_parallel(model, mesh)
rows = slice(rank * 2, rank * 2 + 2)
loss = loss_of(model, tokens[rows], labels[rows])
loss.backward()
part = loss_of(ref, tokens[rows], labels[rows]).item()
errors, sharded = [], []
for n, p in model.named_parameters():
    if isinstance(p, DTensor):  # an expert shard: experts rank·E/ep … of the reference
        local = p.grad.to_local()
        size = local.shape[0]
        errors.append((local - reference[n][rank * size:(rank + 1) * size]).abs().max().item())
        sharded.append(n)
    else:
        errors.append((mean_over_ranks(p.grad) - reference[n]).abs().max().item())
results["ep"] = {"loss": abs(loss.item() - part), "grad": max(errors), "sharded": sharded}

if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
dist.barrier()
dist.destroy_process_group()
end_process(0)
"""


def test_the_toy_gets_context_and_expert_parallelism_through_its_declared_modules(tmp_path):
    script, out = tmp_path / "toy_layouts.py", tmp_path / "out.json"
    script.write_text(PARITY_SCRIPT)
    proc = torchrun(script, 2, str(out), str(REPO), timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    results = json.loads(out.read_text())
    cores = {"allgather": "AllGatherCore", "ring": "RingCore", "ulysses": "UlyssesCore"}
    for method, core in cores.items():
        assert results[method]["core"] == core  # the toy's own core at mixer.core was swapped
        assert results[method]["loss"] <= FP64_TOL, (method, results[method])
        assert results[method]["grad"] <= FP64_TOL, (method, results[method])
    ep = results["ep"]
    assert ep["sharded"] == [f"blocks.{i}.ffn.experts.{w}" for i in range(2) for w in ("up", "down")]
    assert ep["loss"] <= FP64_TOL and ep["grad"] <= FP64_TOL, ep


TRAIN_SCRIPT = """
import json, os, sys
from pathlib import Path
import torch.distributed as dist

sys.path.insert(0, sys.argv[1])
from tests.helpers import toy_experts_family as toy
toy.register()
from engine.config import load_job_config
from engine.parallel.launch import end_process
from engine.train.callbacks import Callback
from engine.train.trainer import train


class DieAfter(Callback):
    \"\"\"Every rank ends at once after step `step`, as a SIGKILL would: no save, no teardown.\"\"\"

    name = "die_after"

    def __init__(self, step):
        self.step = step

    def after_step(self, step, result, loop):
        if step == self.step:
            os._exit(9)


out, extra = Path(sys.argv[2]), sys.argv[3:]
cfg = load_job_config(Path(sys.argv[1]) / "presets" / "debug.toml", [
    "train.seq_len=16", "model.max_seq_len=16", "train.batch_size=2", f"train.max_steps={STEPS}",
    "checkpoint.interval=3", "metrics.log_interval=1", "eval.enabled=false", "scheduler.warmup_steps=1",
    "train.mixed_precision=fp32", "model.num_experts=4", "model.moe_top_k=1", "distributed.dp_shard=2", *extra])
# A real family's name would be in ModelConfig.model_type's Literal (issue 46); model_copy stands in for it.
cfg = cfg.model_copy(update={"model": toy.toy_config(vocab_size=cfg.model.vocab_size)})
die = os.environ.get("TOY_DIE_AFTER")
train(cfg, out, [DieAfter(int(die))] if die else [])  # resumes from out's newest checkpoint; leaves its group
if dist.is_initialized():
    dist.destroy_process_group()
end_process(0)
""".replace("STEPS", "6")


def step_losses(run: Path) -> dict[int, float]:
    """Step → loss, the last record of each step (a resumed run logs the steps after its checkpoint again)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def saved_model(run: Path, step: int) -> dict:
    """The model's tensors, whole, in the checkpoint of `step` (read on one process, without a group)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = run.parent / f"{run.name}-step{step}.pt"
    dcp_to_torch_save(run / "checkpoints" / f"step_{step}", whole)
    return torch.load(whole, weights_only=True)["model"]


def test_the_toy_trains_on_two_processes_under_fsdp_and_expert_parallelism_and_resumes_bitwise(tmp_path):
    """The trainer's own path (build_job → parallelize → steps → checkpoint) on the toy: FSDP over 2 processes,
    then FSDP with its experts split over ep = 2; the checkpoint holds every expert's full tensor. Under FSDP a
    run whose ranks all die after step 5 (between the checkpoints of steps 3 and 6) and is started again resumes
    from step 3 to the uninterrupted run's losses and weights, bitwise."""
    import torch
    import torch.distributed.checkpoint as dcp

    script = tmp_path / "toy_train.py"
    script.write_text(TRAIN_SCRIPT)
    for name, extra in {"fsdp": [], "ep": ["distributed.ep=2"]}.items():
        run = tmp_path / name
        proc = torchrun(script, 2, str(REPO), str(run), *extra, timeout=300)
        assert proc.returncode == 0, proc.stdout[-4000:]
        losses = step_losses(run)
        assert sorted(losses) == list(range(1, 7)) and all(loss == loss for loss in losses.values()), losses
        metadata = dcp.FileSystemReader(str(run / "checkpoints" / "step_6")).read_metadata()
        shapes = {
            key: list(meta.size) for key, meta in metadata.state_dict_metadata.items() if key.endswith("experts.up")
        }
        assert shapes == {f"model.blocks.{i}.ffn.experts.up": [4, 32, 128] for i in range(2)}, shapes  # 4 · dim wide

    killed = tmp_path / "killed"
    died = torchrun(script, 2, str(REPO), str(killed), timeout=300, env={"TOY_DIE_AFTER": "5"})
    assert died.returncode != 0 and sorted(step_losses(killed)) == list(range(1, 6)), died.stdout[-4000:]
    assert sorted(p.name for p in (killed / "checkpoints").iterdir() if p.name.startswith("step_")) == ["step_3"]
    proc = torchrun(script, 2, str(REPO), str(killed), timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    attempts = [json.loads(line) for line in (killed / "attempts.jsonl").read_text().splitlines()]
    assert [(a["event"], a["step"]) for a in attempts] == [("start", 0), ("start", 3), ("end", 6)]  # from step 3
    reference = tmp_path / "fsdp"
    assert step_losses(killed) == step_losses(reference)  # every step, bitwise: before the kill and after
    ours, theirs = saved_model(killed, 6), saved_model(reference, 6)
    assert len(theirs) == len(ours) > 0 and all(torch.equal(ours[k], theirs[k]) for k in theirs)
