"""Pipeline parallelism (engine/parallel/pipeline.py): the stage split, single-process composition of the stage
models, and, under torchrun (gloo, CPU), parity of every schedule with the single-process run of the same global
batch: per-step losses and final weights within parity.FP64_TOL in float64 (the claim is that the schedules
compute the one-process function), also composed with FSDP (pp=2 × dp=2), and with packed documents (every
stage attends within the windows' documents)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from engine.config.model import ModelConfig
from engine.errors import UserError
from engine.model.transformer import Transformer
from engine.parallel.pipeline import check_microbatches, split_stages, stage_layer_names
from engine.parallel.stages import last_stage_cost, stage_layer_counts, stage_layers, stages_per_rank
from tests.helpers.parity import FP64_TOL, Parity
from tests.helpers.torchrun import torchrun


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(**{"dim": 32, "n_layers": 4, "n_heads": 4, "vocab_size": 64, "max_seq_len": 16, **overrides})


@pytest.mark.parametrize(
    ("n_layers", "n_stages", "counts"),
    [
        (4, 2, [2, 2]),
        (4, 4, [1, 1, 1, 1]),
        (8, 4, [2, 2, 2, 2]),
        (6, 4, [1, 2, 2, 1]),
        (5, 2, [3, 2]),
        (3, 2, [2, 1]),
        (7, 3, [2, 3, 2]),
        (10, 4, [2, 3, 3, 2]),
        (1, 1, [1]),
        (5, 1, [5]),
    ],
)
def test_stage_layer_counts_balance_embedding_and_head_as_one_layer_each(n_layers, n_stages, counts):
    assert stage_layer_counts(n_layers, n_stages) == counts
    costs = [c + (s == 0) + (s == n_stages - 1) for s, c in enumerate(counts)]
    assert max(costs) == -(-(n_layers + 2) // n_stages) or min(counts) == 1  # optimal unless every stage is minimal


@pytest.mark.parametrize(
    "n_layers,n_stages,mtp_depth,counts",
    [(4, 2, 2, [3, 1]), (4, 2, 1, [3, 1]), (8, 4, 1, [2, 3, 2, 1]), (6, 2, 1, [4, 2])],
)
def test_the_last_stage_counts_each_prediction_module_as_a_block_and_a_head(n_layers, n_stages, mtp_depth, counts):
    """Each multi-token-prediction module runs a block and the head on the last stage: two blocks' cost."""
    last = last_stage_cost(mtp_depth)
    assert last == 1 + 2 * mtp_depth and stage_layer_counts(n_layers, n_stages, last) == counts
    costs = [c + (s == 0) + (s == n_stages - 1) * last for s, c in enumerate(counts)]
    assert max(costs) == -(-(n_layers + 1 + last) // n_stages) or min(counts) == 1  # optimal unless minimal
    assert [len(r) for r in stage_layers(n_layers, n_stages, mtp_depth)] == counts


def test_stage_layer_names_are_consecutive_and_cover_every_layer():
    names = stage_layer_names(7, 3)
    assert names == [["0", "1"], ["2", "3", "4"], ["5", "6"]]


def test_too_many_stages_are_a_user_error():
    with pytest.raises(UserError, match="every stage needs at least one layer"):
        stage_layer_counts(3, 4)


def test_stages_per_rank():
    assert [stages_per_rank(s) for s in ("gpipe", "1f1b", "interleaved_1f1b")] == [1, 1, 2]
    with pytest.raises(UserError, match="unknown pipeline schedule"):
        stages_per_rank("zero_bubble")


def test_every_configurable_schedule_has_a_stage_count_and_a_torch_schedule():
    import typing

    from engine.config.distributed import DistributedConfig
    from engine.parallel.pipeline import SCHEDULES
    from engine.parallel.stages import STAGES_PER_RANK

    choices = set(typing.get_args(DistributedConfig.model_fields["pp_schedule"].annotation))
    assert set(STAGES_PER_RANK) == set(SCHEDULES) == choices


@pytest.mark.parametrize(
    ("schedule", "pp", "n", "ok"),
    [
        ("gpipe", 4, 1, True),
        ("1f1b", 2, 2, True),
        ("1f1b", 4, 3, False),
        ("1f1b", 2, 5, True),
        ("interleaved_1f1b", 2, 4, True),
        ("interleaved_1f1b", 2, 3, True),
        ("interleaved_1f1b", 2, 1, True),
        ("interleaved_1f1b", 2, 5, False),
        ("interleaved_1f1b", 4, 10, True),
        ("interleaved_1f1b", 4, 9, False),
    ],
)
def test_check_microbatches(schedule, pp, n, ok):
    if ok:
        check_microbatches(schedule, pp, n)
    else:
        with pytest.raises(UserError, match=r"train.grad_accum_steps"):
            check_microbatches(schedule, pp, n)


def test_split_keeps_full_model_names_and_composes_to_the_full_forward():
    torch.manual_seed(0)
    model = Transformer(tiny())
    tokens = torch.randint(0, 64, (2, 16))
    pp, per_rank = 2, 2  # interleaved layout: rank 0 runs stages 0 and 2, rank 1 stages 1 and 3
    by_rank = [split_stages(model, rank, pp, per_rank) for rank in range(pp)]
    assert [[index for index, _ in parts] for parts in by_rank] == [[0, 2], [1, 3]]
    stages = sorted((pair for parts in by_rank for pair in parts), key=lambda pair: pair[0])
    names = [name for _, part in stages for name in part.state_dict()]
    assert sorted(names) == sorted(model.state_dict()) and len(names) == len(set(names))
    assert stages[0][1].tok_embeddings is not None and stages[-1][1].output is not None
    assert all(part.tok_embeddings is None for _, part in stages[1:])
    assert all(part.norm is None and part.output is None for _, part in stages[:-1])
    h = tokens
    for _, part in stages:
        h = part(h)
    torch.testing.assert_close(h, model(tokens), rtol=0, atol=0)
    for _, part in stages:  # a stage built on the meta device is initialised on its own (torchtitan's way)
        part.init_weights()


def test_tied_embeddings_split_into_a_copy_on_the_first_and_the_last_stage():
    """The shared matrix under both of its names, one per end of the pipeline (pipeline.TiedWeight keeps
    the copies' gradients summed); the stages still compute the whole model."""
    model = Transformer(tiny(tie_embeddings=True))
    [(_, first)] = split_stages(model, 0, 2, 1)
    [(_, last)] = split_stages(model, 1, 2, 1)
    assert first.output is None and last.tok_embeddings is None
    assert torch.equal(first.tok_embeddings.weight, last.output.weight)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 8))
    torch.testing.assert_close(last(first(tokens)), model(tokens), rtol=0, atol=0)


PARITY_SCRIPT = textwrap.dedent('''
    import copy, functools, json, sys
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from engine.config.model import ModelConfig
    from engine.model.documents import document_ids
    from engine.model.transformer import Transformer
    from engine.parallel.apply import apply_fsdp
    from engine.parallel.grad_norm import clip_grad_norm
    from engine.parallel.pipeline import StageShapes, build_pipeline
    from engine.train.losses import cross_entropy

    out, dp, tol, schedules = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4:]
    dist.init_process_group("gloo")
    torch.set_default_dtype(torch.float64)  # every model, and the stages' activations (StageShapes below)
    rank, world = dist.get_rank(), dist.get_world_size()
    pp = world // dp
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    cpu = torch.device("cpu")
    ACCUM, BATCH, SEQ, STEPS, CLIP, EVAL_AFTER = 4, 2, 16, 5, 0.5, 2
    loss_fn = functools.partial(cross_entropy, z_loss_weight=1e-3)
    torch.manual_seed(0)
    base = Transformer(ModelConfig(dim=32, n_layers=4, n_heads=4, vocab_size=64, max_seq_len=SEQ))

    EOS = 0  # packed runs ("SCHEDULE+packed"): token 0 ends a document, and the model attends within documents

    def sequences(g):
        """ACCUM * BATCH * dp sequences; about every fifth token is an EOS, so a window holds several documents."""
        data = torch.randint(0, 64, (ACCUM * BATCH * dp, SEQ + 1), generator=g)
        return data.masked_fill(torch.rand(data.shape, generator=g, dtype=torch.float32) < 0.2, EOS)  # as in fp32

    def batches():
        """The global batch of each step."""
        g = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            data = sequences(g)
            yield data[:, :-1], data[:, 1:]

    def held_out():
        """Evaluated after step EVAL_AFTER (the later steps then show that evaluation left training as it was)."""
        data = sequences(torch.Generator().manual_seed(2))
        return data[:, :-1], data[:, 1:]

    def documents(x, packed):
        return document_ids(x, EOS) if packed else None

    def optimizer(params):
        # AdamW turns rounding-level gradient differences of near-zero gradients into update differences of up
        # to ~lr (in fp32, SGD with lr=1 agreed to 6e-8 here), hence float64 and a small lr.
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)

    def reference(packed=False):
        """One process, the whole global batch as ACCUM * dp microbatches of BATCH sequences."""
        model = copy.deepcopy(base)
        opt, losses, norms = optimizer(model.parameters()), [], []
        for step, (x, y) in enumerate(batches(), 1):
            total = 0.0
            for xi, yi in zip(x.chunk(ACCUM * dp), y.chunk(ACCUM * dp)):
                loss = loss_fn(model(xi, doc_ids=documents(xi, packed)), yi) / (ACCUM * dp)
                loss.backward()
                total += loss.item()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            opt.step()
            opt.zero_grad()
            losses.append(total)
            if step == EVAL_AFTER:
                with torch.no_grad():
                    ex, ey = held_out()
                    micro = zip(ex.chunk(ACCUM * dp), ey.chunk(ACCUM * dp))
                    evaluated = sum(
                        loss_fn(model(xi, doc_ids=documents(xi, packed)), yi).item() for xi, yi in micro
                    ) / (ACCUM * dp)
        return losses, norms, model.state_dict(), evaluated

    def shard(part):
        """The trainer's FSDP (each block, then the rest; no resharding between microbatches) on one stage."""
        apply_fsdp(part, mesh["dp"], torch.float32, pipelined=True)  # fp32 compute: casts nothing
        return part

    def pipelined(schedule, packed):
        shapes = StageShapes(BATCH, SEQ, SEQ, 32, 64, torch.float64, torch.float64)
        pipe = build_pipeline(copy.deepcopy(base), mesh["pp"], schedule, ACCUM, loss_fn, cpu, shapes,
                              parallelize_stage=shard if dp > 1 else None)
        params = [p for part in pipe.model_parts for p in part.parameters()]
        opt, losses, norms = optimizer(params), [], []
        dp_rank = mesh["dp"].get_local_rank()
        for step, (x, y) in enumerate(batches(), 1):
            x, y = x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]
            loss = pipe.step_loss(pipe.step(x, y, documents(x, packed)), cpu)
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            losses.append(loss.item() / dp)
            norms.append(clip_grad_norm(params, CLIP, pipe.group).item())
            opt.step()
            opt.zero_grad()
            if step == EVAL_AFTER:
                ex, ey = (t.chunk(dp)[dp_rank] for t in held_out())
                value = pipe.step_loss(pipe.evaluate(ex, ey, documents(ex, packed)), cpu)
                dist.all_reduce(value, group=mesh["dp"].get_group())
                evaluated = value.item() / dp
        state = {}
        for part in pipe.model_parts:
            for name, value in part.state_dict().items():
                state[name] = value.full_tensor() if hasattr(value, "full_tensor") else value
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(state, gathered, dst=0)
        return losses, norms, gathered, pipe.has_first_stage, pipe.has_last_stage, evaluated

    references = {packed: reference(packed) for packed in {False} | {name.endswith("+packed") for name in schedules}}
    results = {"ref_losses": references[False][0], "ref_norms": references[False][1]}
    if True in references:
        results["packed_ref_losses"] = references[True][0]
        results["fewest_documents"] = min(int(document_ids(x, EOS)[:, -1].min()) + 1 for x, _ in batches())
    for name in schedules:
        schedule, packed = name.removesuffix("+packed"), name.endswith("+packed")
        ref_losses, ref_norms, ref_state, ref_eval = references[packed]
        losses, norms, gathered, first, last, evaluated = pipelined(schedule, packed)
        loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        norm_diff = max(abs(a - b) for a, b in zip(norms, ref_norms))
        assert loss_diff <= tol, (schedule, rank, losses, ref_losses)  # every rank; rank 0's are recorded
        assert norm_diff <= tol, (schedule, rank, norms, ref_norms)
        roles = [None] * world
        dist.all_gather_object(roles, (first, last))
        if rank == 0:
            full = {}
            for state in gathered:
                full.update(state)
            diffs = {k: (full[k] - v).abs().max().item() for k, v in ref_state.items()}
            worst = max(diffs, key=diffs.get)
            results[name] = {"loss_diff": loss_diff, "norm_diff": norm_diff, "weight_diff": diffs[worst],
                                 "eval_diff": abs(evaluated - ref_eval),
                                 "worst": worst,
                                 "same_names": sorted(full) == sorted(ref_state), "roles": roles}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    from engine.parallel.launch import end_process
    end_process(0)  # leave without interpreter teardown while gloo's threads live (see end_process)
''')

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b"]


def run_parity(tmp_path, nproc: int, dp: int, schedules: list[str]) -> dict:
    """pp = nproc / dp pipeline ranks, each a group of dp FSDP ranks."""
    script, out = tmp_path / "pp_parity.py", tmp_path / "results.json"
    script.write_text(PARITY_SCRIPT)
    result = torchrun(script, nproc, str(out), str(dp), str(FP64_TOL), *schedules, timeout=180)
    assert result.returncode == 0, result.stdout[-4000:]
    return json.loads(out.read_text())


def check_results(parity: Parity, results: dict, schedules: list[str], pp: int) -> None:
    clipped = [n for n in results["ref_norms"] if n > 0.5]
    assert clipped, "the clip threshold should bite at least once so clipping is compared too"
    for schedule in schedules:
        row = results[schedule]
        assert row["same_names"], schedule
        for key in ("loss_diff", "norm_diff", "weight_diff", "eval_diff"):  # eval: forward only through the schedule
            parity.within(f"{schedule} {key}", row[key], FP64_TOL)
        roles = [tuple(r) for r in row["roles"]]
        assert roles[0][0] and roles[-1][1], roles  # first stage on pp rank 0, last on pp rank pp-1 (loop order)
        if schedule.startswith("interleaved_1f1b") and pp > 1:
            assert not roles[0][1] and not roles[-1][0], roles
    if any(schedule.endswith("+packed") for schedule in schedules):
        assert results["fewest_documents"] >= 2, "every packed window holds several documents"
        ours, plain = results["packed_ref_losses"], results["ref_losses"]
        assert len(ours) == len(plain) > 0 and all(abs(a - b) > 1e-4 for a, b in zip(ours, plain)), (ours, plain)


def test_pipeline_schedules_match_single_process(tmp_path, parity):
    """pp = 2: gpipe (2 stages), 1f1b (2 stages), interleaved_1f1b (4 stages of one layer) in one torchrun;
    gpipe and interleaved_1f1b also with packed documents (data.pack_sequences: every rank's stages get the
    windows' document ids) against one process packing the same windows, whose losses are not the unpacked
    run's. (1F1B with packing, through the trainer: tests/parallel/test_layouts.py.)"""
    schedules = [*SCHEDULES, "gpipe+packed", "interleaved_1f1b+packed"]
    check_results(parity, run_parity(tmp_path, 2, 1, schedules), schedules, pp=2)


def test_pipeline_with_fsdp_matches_single_process(tmp_path, parity):
    """pp = 2 × dp = 2: each stage's blocks and root sharded on the dp submesh, each dp rank half the batch."""
    schedules = ["1f1b", "interleaved_1f1b"]
    check_results(parity, run_parity(tmp_path, 4, 2, schedules), schedules, pp=2)
