"""Context parallelism (engine.parallel.context) trains exactly like one process.

Every process builds the same seeded model, keeps one copy as the single-process reference and lays the other
out with `engine.parallel.apply.parallelize` on the engine's mesh (cp alone, cp × dp_shard, cp × tp); each
takes the same AdamW steps with gradient clipping, the cp copy on its head-tail slice of every sequence. The
models are float64 (the claim is that the layouts compute the same function; in fp32 their reduction orders
alone moved weights by 1.5e-5 on one CPU): the per-step losses (averaged over the ranks, as the trainer logs
them), the gradient norms and the final full weights must agree to parity.FP64_TOL. One launch checks several
layouts, to keep the suite's time. With
data.pack_sequences the windows hold several documents: the reference is the one-process packed model, the cp
ranks get the whole windows' document ids and their head-tail slice of the tokens, as the trainer gives them.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import load_job_config
from engine.errors import ConfigError, UserError
from engine.model.documents import document_ids, document_mask
from engine.model.transformer import Transformer
from engine.parallel.context import (
    ContextParallel,
    UlyssesCore,
    all_positions,
    block_attention,
    document_causal_mask,
    head_tail_indices,
    merge,
    torch_ring_applies,
)
from engine.parallel.memory import estimate_memory, packing_bytes
from engine.plan import check_config
from tests.helpers.parity import FP64_TOL, Parity, model_bound
from tests.helpers.torchrun import torchrun

PARITY_SCRIPT = """
import copy, json, sys
import torch, torch.distributed as dist
from torch.distributed.tensor import DTensor
from engine.config import load_job_config
from engine.plan import check_config
from engine.model.documents import document_ids
from engine.model.transformer import Transformer
from engine.parallel.apply import parallelize
from engine.parallel.context import ContextParallel, apply_context_parallel
from engine.parallel.memory import packing_bytes
from engine.parallel.mesh import ParallelDims, build_mesh
from engine.parallel.tp import loss_context, uses_loss_parallel
from engine.train.losses import build_loss
from engine.train.optim import build_optimizer

out, cases = sys.argv[1], json.loads(sys.argv[2])
dist.init_process_group("gloo")
torch.set_default_dtype(torch.float64)  # every model below; mixed_precision=fp32 casts nothing
TINY = ["--model.dim=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.vocab_size=64",
        "--model.max_seq_len=24", "--train.seq_len=24", "--train.batch_size=2", "--optimizer.lr=1e-3",
        "--train.z_loss_weight=1e-3", "--train.mixed_precision=fp32"]
EOS = 0


def full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


# Bytes of the distinct storages autograd saves in one forward (a collective's pending result, which has no
# storage to name yet, by its size).
def saved_bytes(model, tokens, doc_ids):
    seen = {}

    def pack(t):
        try:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        except RuntimeError:
            seen[id(t)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, doc_ids=doc_ids)
    return sum(seen.values())


# What packing adds to one forward's saved tensors on this rank, measured on a cp model without FSDP (whose
# gathered weights' storages come and go), and the estimate's term (memory.packing_bytes on CPU). Unpacked
# allgather on CPU keeps the lower-right causal mask of each query chunk with more keys than queries ([chunk,
# end] fp32: PyTorch materializes CausalBias there), which CUDA's kernel does not build: added back.
def packing_memory(cfg, mesh, cp, tokens, ids):
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"activation_checkpointing": "none"})})
    torch.set_default_dtype(torch.float32)  # the estimate's dtype
    model = Transformer(cfg.model)
    torch.set_default_dtype(torch.float64)
    apply_context_parallel(model, mesh.get("cp"), cfg.distributed.cp_method, torch.device("cpu"), packed=True)
    rows = slice(0, cfg.train.batch_size)
    measured = saved_bytes(model, cp.shard(tokens[rows]), ids[rows]) - saved_bytes(model, cp.shard(tokens[rows]), None)
    if cfg.distributed.cp_method == "allgather":
        chunk = cfg.train.seq_len // (2 * cp.size)
        ends = [(cp.rank + 1) * chunk, (2 * cp.size - cp.rank) * chunk]
        measured += cfg.model.n_layers * sum(4 * chunk * end for end in ends if end != chunk)
    return measured, packing_bytes(cfg, "cpu")


results = {}
for name, overrides in cases.items():
    cfg = check_config(load_job_config(None, TINY + overrides), dist.get_world_size())
    dims = ParallelDims.from_config(cfg.distributed, dist.get_world_size())
    mesh = build_mesh(dims, "cpu")
    torch.manual_seed(0)
    ref = Transformer(cfg.model)
    model = parallelize(copy.deepcopy(ref), cfg, mesh)
    loss_fn, parallel_loss = build_loss(cfg.train), uses_loss_parallel(dims.tp, cfg.train.loss_fn)
    ref_opt, opt = (build_optimizer(m, cfg.optimizer) for m in (ref, model))
    cp = ContextParallel(mesh.get("cp"))
    dp, dp_rank = dims.dp, mesh.dp_rank
    per_rank = 4 // dp
    res = {"ref_loss": [], "loss": [], "ref_norm": [], "norm": [], "documents": [],
           "core": type(model.layers["0"].attention.core).__name__,
           "positions": cp.shard(torch.arange(24)[None]).flatten().tolist()}
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        batch = torch.randint(0, 64, (4, 25), generator=g)
        tokens, labels = batch[:, :-1], batch[:, 1:]
        ids = None
        if cfg.data.pack_sequences:  # end-of-document tokens (id 0) inside every window: 3 to 5 documents
            tokens = tokens.clone().scatter_(1, torch.randint(0, 23, (4, 3), generator=g), EOS)
            ids = document_ids(tokens, EOS)
            res["documents"].append((ids[:, -1] + 1).tolist())
            if step == 0:
                with torch.no_grad():
                    res["unpacked_loss"] = loss_fn(ref, tokens, labels).item()
        ref_loss = loss_fn(ref, tokens, labels, doc_ids=ids)
        ref_loss.backward()
        res["ref_norm"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item())
        ref_opt.step(); ref_opt.zero_grad()
        rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        with loss_context(parallel_loss):
            whole = None if ids is None else ids[rows]  # the whole windows' ids, as the trainer passes them
            loss = loss_fn(model, cp.shard(tokens[rows]), cp.shard(labels[rows]), doc_ids=whole)
            loss.backward()
        res["norm"].append(full(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)).item())
        opt.step(); opt.zero_grad()
        loss = full(loss).clone()
        dist.all_reduce(loss)
        res["ref_loss"].append(ref_loss.item()); res["loss"].append(loss.item() / dist.get_world_size())
    res["weight_error"] = max((full(p) - q.detach()).abs().max().item()
                              for p, q in zip(model.parameters(), ref.parameters()))
    res["weights"] = len(list(model.parameters()))
    if cfg.data.pack_sequences:
        res["memory"] = packing_memory(cfg, mesh, cp, tokens, ids)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, res["memory"])
        res["memory"] = gathered
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, res["positions"])
    res["positions"] = gathered
    results[name] = res
if dist.get_rank() == 0:
    (__import__("pathlib").Path(out) / "result.json").write_text(json.dumps(results))
dist.barrier()
dist.destroy_process_group()
from engine.parallel.launch import end_process
end_process(0)
"""

CP2 = ["--distributed.cp=2", "--distributed.dp_shard=1"]
TWO_PROCESSES = {
    "allgather": [*CP2, "--distributed.cp_method=allgather"],
    "ring": [*CP2, "--distributed.cp_method=ring"],
    "ulysses": [*CP2, "--distributed.cp_method=ulysses"],
    # recomputation reruns the collectives in backward; QK-norm sees the sharded positions; the output gate
    # (issue 51) scales the cp core's output on each rank's own positions
    "ring_full_ac_qk_norm_gate": [
        *CP2,
        "--distributed.cp_method=ring",
        "--train.activation_checkpointing=full",
        "--model.qk_norm=true",
        "--model.attention_output_gate=true",
    ],
    "ulysses_selective_ac": [*CP2, "--distributed.cp_method=ulysses", "--train.activation_checkpointing=selective"],
    # packed windows (data.pack_sequences): each method's document masks against the one-process packed model;
    # under checkpointing the recomputed blocks (and ring's recomputed pieces) get the same masks
    "allgather_packed": [*CP2, "--distributed.cp_method=allgather", "--data.pack_sequences=true"],
    "ring_packed_full_ac": [
        *CP2,
        "--distributed.cp_method=ring",
        "--data.pack_sequences=true",
        "--train.activation_checkpointing=full",
    ],
    "ulysses_packed": [*CP2, "--distributed.cp_method=ulysses", "--data.pack_sequences=true"],
}
FOUR_PROCESSES = {
    "cp2_dp_shard2": ["--distributed.cp=2", "--distributed.dp_shard=2", "--distributed.cp_method=ring"],
    # HSDP: replicated over dp_replicate, sharded over dp_shard × cp (here 1 × 2)
    "cp2_hsdp2": ["--distributed.cp=2", "--distributed.dp_replicate=2", "--distributed.dp_shard=1"],
    "cp2_tp2": ["--distributed.cp=2", "--distributed.tp=2", "--distributed.dp_shard=1"],
    "cp2_tp2_packed": [
        "--distributed.cp=2",
        "--distributed.tp=2",
        "--distributed.dp_shard=1",
        "--data.pack_sequences=true",
    ],
    "cp2_tp2_ulysses": [
        "--distributed.cp=2",
        "--distributed.tp=2",
        "--distributed.dp_shard=1",
        "--distributed.cp_method=ulysses",
        "--model.n_heads=8",
        "--model.n_kv_heads=4",
        "--model.dim=64",
    ],
}
CORES = {"allgather": "AllGatherCore", "ring": "RingCore", "ulysses": "UlyssesCore"}


def run_cases(tmp_path, cases: dict[str, list[str]], nproc: int) -> dict:
    script = tmp_path / "cp_parity.py"
    script.write_text(PARITY_SCRIPT)
    result = torchrun(script, nproc, str(tmp_path), json.dumps(cases), timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    return json.loads((tmp_path / "result.json").read_text())


def assert_parity(parity: Parity, results: dict, cases: dict[str, list[str]]) -> None:
    """Losses (about 4.2) and gradient norms (relative) of the 4 steps, and the final weights, within FP64_TOL:
    float64 rounding is 2^29 times finer than the fp32 deviations seen (1.5e-5 → 3e-14), see tests/helpers/parity.py."""
    assert sorted(results) == sorted(cases)
    for name, res in results.items():
        method = next((arg.split("=")[1] for arg in cases[name] if "cp_method" in arg), "allgather")
        assert res["core"] == CORES[method], name  # the cp core ran, not the plain one
        assert len(res["loss"]) == len(res["ref_loss"]) == len(res["norm"]) == len(res["ref_norm"]) == 4
        losses = max(abs(ours - ref) for ours, ref in zip(res["loss"], res["ref_loss"]))
        parity.within(f"{name} losses", losses, FP64_TOL)
        norms = max(abs(ours / ref - 1) for ours, ref in zip(res["norm"], res["ref_norm"]))
        parity.within(f"{name} grad norms (relative)", norms, FP64_TOL)
        assert res["weights"] > 0, name
        parity.within(f"{name} weights", res["weight_error"], FP64_TOL)
        # the cp ranks held the head-tail halves: 0-5 with 18-23, and 6-11 with 12-17
        positions = {tuple(p) for p in res["positions"]}
        assert positions == {(*range(6), *range(18, 24)), (*range(6, 12), *range(12, 18))}, name
        if "--data.pack_sequences=true" in cases[name]:  # packing ran: several documents, and they mattered
            documents = [n for step in res["documents"] for n in step]
            assert len(documents) == 16 and min(documents) >= 3, (name, documents)
            assert abs(res["unpacked_loss"] - res["ref_loss"][0]) > 1e-4, name  # 10^6× the tolerance
            # the memory estimate's packing term is what packing adds to the saved tensors, on each rank
            assert len(res["memory"]) == len(res["positions"]) and all(
                measured == estimated > 0 for measured, estimated in res["memory"]
            ), (
                name,
                res["memory"],
            )


def test_context_parallel_matches_one_process_for_every_method(tmp_path, parity):
    assert_parity(parity, run_cases(tmp_path, TWO_PROCESSES, 2), TWO_PROCESSES)


@pytest.mark.slow
def test_context_parallel_composes_with_fsdp_and_tensor_parallel(tmp_path, parity):
    assert_parity(parity, run_cases(tmp_path, FOUR_PROCESSES, 4), FOUR_PROCESSES)


def test_head_tail_split_balances_causal_work():
    """Each rank gets one early and one late chunk, so every rank scores the same number of (query, key)
    pairs under the causal mask; a plain split gives the last rank 3× the first's at cp = 2."""
    seq, cp = 24, 2
    parts = [head_tail_indices(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    work = [int((p + 1).sum()) for p in parts]  # position p attends p + 1 keys
    assert work[0] == work[1] == seq * (seq + 1) // 4
    plain = [int((torch.arange(r * 12, (r + 1) * 12) + 1).sum()) for r in range(cp)]
    assert plain[1] > 2.5 * plain[0]
    assert all_positions(12, cp, torch.device("cpu")).tolist() == torch.cat(parts).tolist()


def test_ring_blocks_merge_to_full_attention_with_gradients(parity):
    """The ring's pieces on one process: attention over two key blocks (one seen by no early query, as in the
    head-tail layout) merged by log-sum-exp equals one causal SDPA, values and gradients."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 8, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    pos = torch.arange(8)
    first, second = slice(0, 4), slice(4, 8)
    out, lse = block_attention(q, k[:, :, second], v[:, :, second], pos[4:][None, :] <= pos[:, None])
    block_out, block_lse = block_attention(q, k[:, :, first], v[:, :, first], pos[:4][None, :] <= pos[:, None])
    merged, _ = merge(out, lse, block_out, block_lse)
    parity.close(merged.to(q.dtype), expected, atol=FP64_TOL, what="outputs")  # fp64, values of order 1
    grads = torch.autograd.grad(merged.sum(), (q, k, v))
    for got, want, name in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v)), "qkv"):
        assert torch.isfinite(got).all()
        parity.close(got, want, atol=FP64_TOL, what=f"grad {name}")


def test_ring_merge_of_a_block_some_queries_see_nothing_of(parity):
    """Packed windows under the ring: a query whose document starts after a whole key block sees none of it
    (its row of the block's mask is all False). That block's log-sum-exp is MASKED-sized and gets no weight in
    the merge: the merged result equals one SDPA under the whole window's document mask, values and gradients,
    with no NaN (fp64)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    tokens = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 4], [5, 0, 6, 7, 0, 8, 9, 3]])
    ids = document_ids(tokens, 0)  # row 0: documents 0-2, 3-6, 7; row 1: 0-1, 2-4, 5-7
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(ids))
    pos = torch.arange(8)
    first, second = pos[:4], pos[4:]
    first_mask = document_causal_mask(ids, pos, first)
    assert (~first_mask).all(-1).any(), "some queries see nothing of the first block"
    out, lse = block_attention(q, k[:, :, second], v[:, :, second], document_causal_mask(ids, pos, second))
    block_out, block_lse = block_attention(q, k[:, :, first], v[:, :, first], first_mask)
    merged, total = merge(out, lse, block_out, block_lse)
    assert torch.isfinite(merged).all() and torch.isfinite(total).all()
    parity.close(merged.to(q.dtype), expected, atol=FP64_TOL, what="outputs")  # fp64, values of order 1
    grads = torch.autograd.grad(merged.sum(), (q, k, v))
    for got, want, name in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v)), "qkv"):
        assert torch.isfinite(got).all()
        parity.close(got, want, atol=FP64_TOL, what=f"grad {name}")


class TwoRanks:
    """Stands for the cp mesh of rank 0 of 2 where no collective runs."""

    def size(self):
        return 2

    def get_local_rank(self):
        return 0


def test_packed_positions_are_the_whole_windows_document_positions():
    """The hook gives rank 0 of 2 the in-document positions of its head-tail slice of the whole window, and
    hands its cores the whole window's document ids (allgather, ring) or the one-process mask (ulysses)."""
    cfg = load_job_config(None, ["--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.vocab_size=64"])
    model = Transformer(cfg.model)
    tokens = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 4]])
    ids = document_ids(tokens, 0)
    held = tokens[:, [0, 1, 6, 7]]
    _, kwargs = ContextParallel(TwoRanks()).positions_hook(model, (held,), {"doc_ids": ids})
    assert kwargs["positions"].tolist() == [[0, 1, 3, 0]] and kwargs["doc_ids"] is None
    assert kwargs["attention_mask"] is ids
    _, kwargs = ContextParallel(TwoRanks(), UlyssesCore.window_mask).positions_hook(model, (held,), {"doc_ids": ids})
    torch.testing.assert_close(kwargs["attention_mask"], document_mask(ids))


def test_generation_under_context_parallelism_is_refused():
    """A KV cache holds the whole sequence on one process: the cp hook refuses it (exit 2 through UserError)."""
    cfg = load_job_config(None, ["--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.vocab_size=64"])
    model = Transformer(cfg.model)
    model.register_forward_pre_hook(ContextParallel(TwoRanks()).positions_hook, with_kwargs=True)
    with pytest.raises(UserError, match="generation with a KV cache"):
        model(torch.zeros(1, 4, dtype=torch.long), model.new_kv_cache(1, 8))


def test_positions_pick_the_rope_rows(parity):
    """Default positions are arange: the same computation, bit for bit. Shifted positions give the same
    logits only up to the fp32 RoPE tables' rounding (angles p·θ rounded at ≤ U32 · 11 rad): parity.model_bound
    covers that with room."""
    cfg = load_job_config(None, ["--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.vocab_size=64"])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    tokens = torch.randint(0, 64, (1, 8))
    natural = model(tokens, positions=torch.arange(8))
    parity.close(natural, model(tokens), atol=0, what="default positions")
    # RoPE sees only distances: shifted positions change nothing, spread ones do
    bound = model_bound(cfg.model, natural.abs().max().item())
    parity.close(model(tokens, positions=torch.arange(8) + 3), natural, atol=bound, what="shifted positions")
    assert not torch.allclose(model(tokens, positions=torch.arange(8) * 2), natural)


def test_memory_estimate_of_packing_masks_under_cp():
    """The packed windows' masks per rank under cp = 2 (memory.packing_bytes, for a GPU run, bf16, 8 layers,
    windows of 4096): allgather's two [chunk, end] masks are 5/16 of one process's [seq, seq] one; ring's boolean
    piece masks ([local, local] and [local, chunk], one byte) 3/8 of one process's seq² elements, less the causal
    [local, local] mask the unpacked ring keeps already; ulysses counts the
    one-process FlexAttention block mask (it attends over the whole window). Measured against the saved tensors
    on CPU in test_context_parallel_matches_one_process_for_every_method."""
    base = ["--model.dim=256", "--model.n_layers=8", "--model.n_heads=4", "--model.max_seq_len=4096"]
    base += [
        "--train.seq_len=4096",
        "--train.batch_size=2",
        "--train.mixed_precision=bf16",
        "--data.pack_sequences=true",
    ]
    cp2 = ["--distributed.cp=2", "--distributed.dp_shard=1"]

    def term(overrides: list[str], world: int, device: str = "cuda") -> int:
        return packing_bytes(check_config(load_job_config(None, base + overrides), world), device)

    seq, batch, layers, local = 4096, 2, 8, 2048
    rope = 2 * 4 * (batch - 1) * local * 64
    one_process_sdpa = term([], 1, "cpu") - 2 * 4 * (batch - 1) * seq * 64
    assert one_process_sdpa == layers * 2 * batch * seq * seq
    assert term([*cp2, "--distributed.cp_method=allgather"], 2) == one_process_sdpa * 5 // 16 + rope
    ring = layers * (batch * local * (local + local // 2) - local * local)
    assert term([*cp2, "--distributed.cp_method=ring"], 2) == ring + rope
    n = seq // 128
    assert term([*cp2, "--distributed.cp_method=ulysses"], 2) == 4 * 4 * batch * (n + n * n) + rope


@pytest.mark.parametrize(
    ("overrides", "field", "message"),
    [
        (["--distributed.cp=2", "--train.seq_len=30"], "train.seq_len", "divisible by 2 × distributed.cp (4)"),
        (
            ["--distributed.cp=2", "--distributed.cp_method=ulysses", "--model.n_kv_heads=1"],
            "distributed.cp_method",
            "divisible by tp × cp (2)",
        ),
        (["--distributed.cp=2", "--distributed.pp=2"], "distributed.pp", "does not support pipeline parallelism"),
        (["--distributed.cp=2", "--model.num_experts=4"], "model.num_experts", "does not support MoE models"),
        (["--distributed.cp_method=ring"], "distributed.cp_method", "distributed.cp = 1"),
    ],
)
def test_layouts_context_parallelism_cannot_run_are_refused(overrides, field, message):
    base = ["--model.dim=32", "--model.n_layers=2", "--model.n_heads=2", "--model.vocab_size=64", "--train.seq_len=32"]
    cfg = load_job_config(None, base + overrides)
    with pytest.raises(ConfigError) as caught:
        check_config(cfg, world_size=cfg.distributed.cp * cfg.distributed.pp)
    issues = [issue for issue in caught.value.issues if issue.path == field]
    assert len(issues) == 1 and message in issues[0].problem, caught.value.issues


def test_memory_estimate_divides_activations_by_cp():
    """Every rank holds seq_len / cp positions: ulysses saves exactly half of one process's activations at
    cp = 2; allgather adds the other rank's K and V of every layer (fp32: 4 bytes × 2 × kv width)."""
    base = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2"]
    base += ["--model.vocab_size=128", "--train.seq_len=64", "--train.batch_size=2", "--train.mixed_precision=fp32"]
    cp2 = ["--distributed.cp=2", "--distributed.dp_shard=1"]

    def activations(overrides: list[str], world: int) -> int:
        [stage] = estimate_memory(check_config(load_job_config(None, base + overrides), world), world)
        return stage.activations

    one = activations([], 1)
    assert activations([*cp2, "--distributed.cp_method=ulysses"], 2) * 2 == one
    kv_width = 2 * 16
    gathered = 2 * (2 * 32) * 4 * 2 * kv_width  # layers × (batch × local positions) × fp32 × (k, v) × width
    assert activations(cp2, 2) == one // 2 + gathered


def test_packed_windows_never_take_torch_s_ring():
    """PyTorch's CUDA ring takes no attention mask (it raises on one): with packed windows `ring` runs Forge's
    own ring core on every device, and without them PyTorch's where its kernels apply (one K/V head a head)."""
    from engine.config.model import ModelConfig

    cuda = torch.device("cuda")  # only its type is read: no GPU needed
    mha = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=64, max_seq_len=16))
    gqa = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16))
    assert torch_ring_applies(mha, cuda) and not torch_ring_applies(mha, cuda, packed=True)
    assert not torch_ring_applies(gqa, cuda) and not torch_ring_applies(mha, torch.device("cpu"))
