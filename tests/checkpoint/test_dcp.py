"""DCP checkpoints written by training load back into a fresh model and optimizer exactly."""

from __future__ import annotations

import json

import torch

from engine.checkpoint.dcp import (
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from engine.model.transformer import Transformer


def test_round_trip_restores_weights_and_optimizer(tmp_path):
    model, optimizer = trained_pair(0)
    save_checkpoint(tmp_path, 3, model, optimizer, {"step": 3, "tokens_seen": 96})
    fresh, fresh_opt = trained_pair(1)  # different weights and moments
    state = load_checkpoint(tmp_path / "step_3", fresh, fresh_opt)
    assert state == {"step": 3, "tokens_seen": 96}
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    ours, theirs = optimizer.state_dict()["state"], fresh_opt.state_dict()["state"]
    for key in ours:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ours[key][name], theirs[key][name])


def test_incomplete_folders_are_not_checkpoints_and_pruning_keeps_newest(tmp_path):
    model, optimizer = trained_pair(0)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, optimizer, {"step": step})
    (tmp_path / "step_4").mkdir()  # a save killed before it finished
    (tmp_path / "step_4" / ".metadata").write_bytes(b"")
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [1, 2, 3]
    assert latest_checkpoint(tmp_path)[0] == 3 and (tmp_path / "latest").read_text() == "step_3"
    prune_checkpoints(tmp_path, keep_last_n=2, saved_step=3)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 3]
    assert not (tmp_path / "step_1").exists() and (tmp_path / "step_4").exists()  # never the one being written


# --- the checkpoint manager: background saves, damaged checkpoints, starting from another run ---------------

import pickle  # noqa: E402

import pytest  # noqa: E402

from engine.checkpoint.manager import Checkpointer, initialize_from  # noqa: E402
from engine.config.checkpoint import CheckpointConfig  # noqa: E402
from engine.errors import UserError  # noqa: E402
from tests.helpers.checkpoints import CFG, trained_pair  # noqa: E402


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_saves_hold_the_state_of_their_step_even_when_training_goes_on(tmp_path, mode):
    model, optimizer = trained_pair(0)
    snapshot, _ = trained_pair(0)
    ckpt = Checkpointer(tmp_path, CheckpointConfig(async_mode=mode, keep_last_n=1), torch.device("cpu"))
    ckpt.save(3, model, optimizer, {"step": 3})
    ckpt.wait_for_staging()  # what the training step does before it changes the weights
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next optimizer step, while the write may still be running
    assert ckpt.has(3)
    assert ckpt.wait() == ((3, tmp_path / "step_3") if mode != "disabled" else None)
    fresh, fresh_opt = trained_pair(1)
    assert load_checkpoint(tmp_path / "step_3", fresh, fresh_opt) == {"step": 3}
    assert same_weights(fresh, snapshot) and not same_weights(fresh, model)
    ckpt.save(4, model, optimizer, {"step": 4})
    ckpt.wait()
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [4] and (tmp_path / "latest").read_text() == "step_4"


def three_checkpoints(root):
    model, optimizer = trained_pair(0)
    for step in (1, 2, 3):
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        save_checkpoint(root, step, model, optimizer, {"step": step})
    return Checkpointer(root, CheckpointConfig(), torch.device("cpu"))


def listing(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*"))


@pytest.mark.parametrize(
    "damage",
    [
        "truncated shard",
        "missing metadata",
        "bad train state",
        "deleted latest",
        "foreign pickle",
        "dotted name pickle",
        "pickled value",
    ],
)
def test_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, damage):
    ckpt = three_checkpoints(tmp_path)
    newest = tmp_path / "step_3"
    if damage == "truncated shard":
        shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "missing metadata":
        (newest / ".metadata").unlink()
    elif damage == "bad train state":
        (newest / "train_state.json").write_text('{"step": ')
    elif damage == "deleted latest":
        (tmp_path / "latest").unlink()
    elif damage == "foreign pickle":  # a .metadata that would run code if it were unpickled naively
        (newest / ".metadata").write_bytes(pickle.dumps(Exploit(str(tmp_path / "pwned"))))
    elif damage == "dotted name pickle":  # an allowed module's import reached through a dotted name
        (newest / ".metadata").write_bytes(dotted_global_pickle(str(tmp_path / "pwned")))
    else:  # a non-tensor value (the optimizer's lr) replaced by an object that runs code when loaded
        poison_bytes_value(newest, Exploit(str(tmp_path / "pwned")))
    before = listing(tmp_path)
    model, optimizer = trained_pair(1)
    path, state = ckpt.restore(model, optimizer)
    expected = 3 if damage == "deleted latest" else 2
    assert path == tmp_path / f"step_{expected}" and state == {"step": expected}
    assert listing(tmp_path) == before, "restoring never deletes or changes a file"
    assert not (tmp_path / "pwned").exists()


def dotted_global_pickle(path: str) -> bytes:
    """Protocol-4 pickle calling os.system("touch PATH"), with os.system reached as the dotted name
    `os.system` inside DCP's metadata module (which imports os): what a module-level allow-list lets through."""
    module, name, command = b"torch.distributed.checkpoint.metadata", b"os.system", f"touch {path}".encode()
    return (
        b"\x80\x04"
        + b"\x8c"
        + bytes([len(module)])
        + module
        + b"\x8c"
        + bytes([len(name)])
        + name
        + b"\x93"
        + b"\x8c"
        + bytes([len(command)])
        + command
        + b"\x85R."
    )


def poison_bytes_value(step_dir, value) -> None:
    """Rewrite one pickled non-tensor entry of a DCP checkpoint in place (same length is not needed: DCP
    records offsets, so the entry is appended and the metadata pointed at it)."""
    import io

    metadata = pickle.loads((step_dir / ".metadata").read_bytes())
    index = next(i for i in metadata.storage_data if i.fqn.endswith(".lr"))
    info = metadata.storage_data[index]
    buffer = io.BytesIO()
    torch.save(value, buffer)
    shard = step_dir / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buffer.getvalue())
    metadata.storage_data[index] = type(info)(
        info.relative_path, offset, len(buffer.getvalue()), info.transform_descriptors
    )
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))


class Exploit:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_every_checkpoint_damaged_is_a_clear_error_and_nothing_is_deleted(tmp_path):
    ckpt = three_checkpoints(tmp_path)
    for step in (1, 2, 3):
        (tmp_path / f"step_{step}" / ".metadata").unlink()
    before = listing(tmp_path)
    model, optimizer = trained_pair(1)
    with pytest.raises(UserError, match="no readable checkpoint") as err:
        ckpt.restore(model, optimizer)
    assert all(f"step_{s}" in err.value.message for s in (1, 2, 3))
    assert listing(tmp_path) == before


def test_load_path_initialises_weights_except_excluded_prefixes(tmp_path):
    source, optimizer = trained_pair(0)
    save_checkpoint(tmp_path / "checkpoints", 3, source, optimizer, {"step": 3})
    save_checkpoint(tmp_path / "checkpoints", 5, source, optimizer, {"step": 5})
    torch.manual_seed(7)
    target = Transformer(CFG)
    fresh_output = target.output.weight.detach().clone()
    loaded = initialize_from(tmp_path, target, ["output."])  # a run directory: its newest checkpoint
    assert "output.weight" not in loaded and "layers.0.attention.wq.weight" in loaded
    assert torch.equal(target.output.weight, fresh_output)
    for name, value in source.state_dict().items():
        if not name.startswith("output."):
            assert torch.equal(target.state_dict()[name], value), name
    initialize_from(tmp_path / "checkpoints" / "step_3", Transformer(CFG), [])


def test_load_path_mistakes_are_user_errors(tmp_path):
    source, optimizer = trained_pair(0)
    save_checkpoint(tmp_path, 3, source, optimizer, {"step": 3})
    (tmp_path / "step_4").mkdir()
    wider = Transformer(CFG.model_copy(update={"dim": 64}))
    for path, message in [
        (tmp_path / "nope", "does not exist"),
        (tmp_path / "step_4", "incomplete"),
        (tmp_path / "step_4" / "nothing", "does not exist"),
    ]:
        with pytest.raises(UserError, match=message):
            initialize_from(path, Transformer(CFG), [])
    with pytest.raises(UserError, match="does not fit this model"):
        initialize_from(tmp_path, wider, [])
    with pytest.raises(UserError, match="match no parameter: outptu"):
        initialize_from(tmp_path, Transformer(CFG), ["outptu"])
    with pytest.raises(ValueError, match=r"exclude_from_loading applies to checkpoint.load_path"):
        CheckpointConfig(exclude_from_loading=["output."])


ASYNC_SCRIPT = """
import sys, threading, time, torch, torch.distributed as dist
from concurrent.futures import Future
from pathlib import Path
import torch.distributed.checkpoint as dcp
import engine.checkpoint.manager as manager
from engine.checkpoint.manager import Checkpointer
from engine.config.checkpoint import CheckpointConfig
from engine.config.model import ModelConfig
from engine.model.transformer import Transformer
from engine.config.optimizer import OptimizerConfig
from engine.train.optim import build_optimizer

dist.init_process_group("gloo")
root, mode = Path(sys.argv[1]), sys.argv[2]


def finishing_late(start):
    # Rank 1's upload completes 0.5 s after rank 0's: the ranks must still finish the save at the same step.
    def start_late(*args, **kwargs):
        staging, upload = start(*args, **kwargs)
        late = Future()
        upload.add_done_callback(lambda done: threading.Timer(0.5, late.set_result, [done.result()]).start())
        return staging, late
    return start_late


dcp_async_save = dcp.async_save


def recording_group(*args, **kwargs):
    # What DCP's collectives will run on, written before they run (on a wrong group they may hang): a gloo
    # group of both ranks that is neither the training group nor the one poll() asks on.
    group = kwargs.get("process_group")
    with open(root.parent / f"group_rank{dist.get_rank()}", "a") as record:
        print([
            group is not None and group not in (dist.group.WORLD, ckpt.control),
            group is not None and dist.get_backend(group),
            group is not None and dist.get_process_group_ranks(group),
        ], file=record)
    return dcp_async_save(*args, **kwargs)


dcp.async_save = recording_group
if dist.get_rank() == 1:
    manager.start_async_save = finishing_late(manager.start_async_save)
torch.manual_seed(0)
model = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16))
optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2))
ckpt = Checkpointer(root, CheckpointConfig(async_mode=mode), torch.device("cpu"))
finished, step = [], 0
while not finished and step < 300:  # poll() is collective: both ranks see the save finish at the same step
    step += 1
    time.sleep(0.1)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    for p in model.parameters():  # what data parallelism does: every rank applies the mean gradient
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    ckpt.wait_for_staging()
    optimizer.step()
    optimizer.zero_grad()
    if step == 3:
        torch.save(model.state_dict(), root.parent / f"expected_rank{dist.get_rank()}.pt")
        ckpt.save(3, model, optimizer, {"step": 3})  # returns at once; the next steps run while it writes
    if ckpt.poll():
        finished.append(step)
assert ckpt.wait() is None and len(finished) == 1, finished
(root.parent / f"finished_rank{dist.get_rank()}").write_text(str(finished[0]))
dist.barrier()
dist.destroy_process_group()
from engine.parallel.launch import end_process
end_process(0)  # leave without interpreter teardown while gloo's threads live (see end_process)
"""


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_async_save_with_two_ranks_uses_its_own_gloo_group_and_holds_its_step(tmp_path, mode):
    from tests.helpers.torchrun import torchrun

    script = tmp_path / "save.py"
    script.write_text(ASYNC_SCRIPT)
    result = torchrun(script, 2, str(tmp_path / "ckpt"), mode, timeout=120)
    for rank in range(2):  # per dcp.async_save call: [a group of its own, its backend, its ranks]
        given = tmp_path / f"group_rank{rank}"
        assert given.exists(), result.stdout[-3000:]
        assert given.read_text().splitlines() == ["[True, 'gloo', [0, 1]]"], (rank, given.read_text())
    assert result.returncode == 0, result.stdout[-3000:]
    # Each rank writes its own file: two ranks printing to one pipe can interleave their lines.
    finished = [(tmp_path / f"finished_rank{rank}").read_text() for rank in range(2)]
    assert finished[0] == finished[1], finished
    model, _ = trained_pair(5)
    assert load_checkpoint(tmp_path / "ckpt" / "step_3", model) == {"step": 3}
    expected = torch.load(tmp_path / "expected_rank0.pt", weights_only=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())


def test_pruning_after_a_fallback_keeps_what_the_run_resumed_from(tmp_path):
    model, optimizer = trained_pair(0)
    for step in (10, 20):
        save_checkpoint(tmp_path, step, model, optimizer, {"step": step})
    (tmp_path / "step_20" / ".metadata").unlink()  # damaged: the run falls back to step 10
    ckpt = Checkpointer(tmp_path, CheckpointConfig(keep_last_n=1), torch.device("cpu"))
    assert ckpt.restore(*trained_pair(1))[1] == {"step": 10}
    ckpt.save(15, model, optimizer, {"step": 15})  # the resumed run's next checkpoint
    assert (tmp_path / "step_15" / "COMPLETE").is_file() and (tmp_path / "latest").read_text() == "step_15"
    assert (tmp_path / "step_20").is_dir(), "a later folder is not this run's to judge by its number"
    assert ckpt.restore(*trained_pair(1))[1] == {"step": 15}


RNG_SCRIPT = """
import json, random, sys
import numpy as np, torch, torch.distributed as dist
from engine.checkpoint.rng import every_rank_rng_state, restore_rank_rng
from engine.parallel.launch import end_process

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank), random.seed(rank), np.random.seed(rank)
saved = every_rank_rng_state()
box = [json.loads(json.dumps(saved))]
dist.broadcast_object_list(box, src=0)  # every rank reads the train state rank 0 wrote


def draw():
    return [torch.rand(3).tolist(), random.random(), float(np.random.rand())]


first = draw()
restore_rank_rng(box[0])
again = draw()
restore_rank_rng(box[0][:1])  # a run resumed under another number of processes
fallback = draw()
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump({"first": first, "again": again, "fallback": fallback, "saved": len(box[0]),
               "kept_on_rank_0_only": saved is None if rank else saved is not None}, f)
dist.barrier()
dist.destroy_process_group()
end_process(0)
"""


def test_each_rank_resumes_its_own_random_generators(tmp_path):
    """Python, NumPy and torch generators of every rank go through the train state's JSON; each rank draws
    the same numbers again, and under another number of processes every rank continues rank 0's."""
    from tests.helpers.torchrun import torchrun

    script = tmp_path / "rng.py"
    script.write_text(RNG_SCRIPT)
    result = torchrun(script, 2, str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["first"] != ranks[1]["first"], "the ranks were seeded differently"
    for rank in ranks:
        assert rank["again"] == rank["first"] and rank["fallback"] == ranks[0]["first"]
        assert rank["saved"] == 2 and rank["kept_on_rank_0_only"]
