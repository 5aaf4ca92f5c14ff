"""Document-aware packing (data.pack_sequences): a document inside a packed window is computed exactly as if
it were run alone, in one process and under tensor parallelism and FSDP.

The reference is the model itself on each document alone (plain causal attention, positions from 0), which
shares no code with the packed path's mask and per-document positions (engine.model.documents).
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.config.model import ModelConfig
from engine.model.documents import document_block_mask, document_ids, document_mask, document_positions
from engine.model.transformer import Transformer
from engine.plan import check_config
from tests.helpers.parity import FP64_TOL, model_bound
from tests.helpers.torchrun import torchrun

EOS = 0
CFG = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 64, "max_seq_len": 32}


def documents_of(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    """Documents of the given lengths, each ending in EOS and holding no other EOS."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.cat([torch.randint(1, CFG["vocab_size"], (n - 1,), generator=g), torch.tensor([EOS])]) for n in lengths
    ]


def test_document_ids_positions_and_mask_on_a_known_window():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, 8, 9, 10]])
    ids = document_ids(tokens, EOS)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    mask = document_mask(ids)[0, 0]
    assert mask.shape == (8, 8)
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False]
    assert mask[7].tolist() == [False] * 5 + [True] * 3
    assert not mask.triu(1).any(), "never attends to a later token"


def test_packed_documents_match_each_document_alone(parity):
    """Two windows of 16 tokens: [a(5) b(7) c(4)] and [d(6) e(10 of 13)], then e's last 3 tokens open a third
    window [e(3) f(13)]: e is split across windows. Logits of every document (and of each part of e) equal
    the model run on it alone, and the gradients of a per-token loss equal the sum over documents alone
    (float64: the same function, summed in another order)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CFG)).double()
    a, b, c, d, e, f = documents_of([5, 7, 4, 6, 13, 13])
    windows = torch.stack([torch.cat([a, b, c]), torch.cat([d, e[:10]]), torch.cat([e[10:], f])])
    pieces = [[a, b, c], [d, e[:10]], [e[10:], f]]
    weights = torch.randn(*windows.shape, CFG["vocab_size"], generator=torch.Generator().manual_seed(1))

    logits = model(windows, doc_ids=document_ids(windows, EOS))
    (logits * weights).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    checked = 0
    for row, parts in enumerate(pieces):
        start = 0
        for doc in parts:
            span = slice(start, start + len(doc))
            alone = model(doc[None])  # a document alone: positions from 0, plain causal attention
            parity.close(logits[row, span], alone[0], atol=FP64_TOL, what=f"logits of window {row}'s documents")
            (alone[0] * weights[row, span]).sum().backward()
            start, checked = start + len(doc), checked + 1
        assert start == windows.shape[1]
    assert checked == 7
    # e's first part in its window is e's prefix, computed as the whole of e would compute it
    prefix = model(e[None])[0, :10]
    parity.close(logits[1, 6:], prefix, atol=FP64_TOL, what="split document's prefix")
    assert len(packed_grads) == len(list(model.parameters()))
    parity.close(packed_grads, {n: p.grad for n, p in model.named_parameters()}, atol=FP64_TOL, what="gradients")
    # the mask mattered: without it the same windows give other logits
    assert (model(windows) - logits).abs().max() > 1e-2


def test_one_document_window_packs_like_plain_causal_attention(parity):
    """A window without an end-of-document token is one document: packing changes nothing in it (float64)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CFG)).double()
    tokens = torch.randint(1, CFG["vocab_size"], (2, 16))
    parity.close(model(tokens, doc_ids=document_ids(tokens, EOS)), model(tokens), atol=FP64_TOL, what="logits")


PARALLEL_SCRIPT = """
import copy, json, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from engine.config.model import ModelConfig
from engine.model.documents import document_ids
from engine.model.transformer import Transformer
from engine.parallel.tp import apply_tensor_parallel

out, cfg_args, eos = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo")
torch.set_default_dtype(torch.float64)  # the layouts compute the one-process function: compared in float64
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
ref = Transformer(ModelConfig(**cfg_args))
g = torch.Generator().manual_seed(3)
tokens = torch.randint(1, cfg_args["vocab_size"], (2, 16), generator=g)
tokens[0, [4, 9]] = eos  # documents of 5, 5 and 6 tokens
tokens[1, [2, 13]] = eos  # 3, 11 and 2 tokens
labels = torch.randint(0, cfg_args["vocab_size"], (2, 16), generator=g)
ids = document_ids(tokens, eos)


def full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def loss_of(model, rows):
    logits = model(tokens[rows], doc_ids=ids[rows])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[rows].flatten()), full(logits)


ref_loss, ref_logits = loss_of(ref, slice(None))
ref_loss.backward()
ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
# each document alone, for the logits: the parallel models are compared with the unpacked computation too
alone = torch.zeros_like(ref_logits)
for row in range(2):
    bounds = [0, *(i + 1 for i in (tokens[row] == eos).nonzero().flatten().tolist() if i + 1 < 16), 16]
    for s, e in zip(bounds, bounds[1:]):
        alone[row, s:e] = ref(tokens[row : row + 1, s:e])[0].detach()
res = {"alone_vs_ref": (alone - ref_logits).abs().max().item()}

# tensor parallelism over both ranks: every rank sees both windows
tp_model = copy.deepcopy(ref)
tp_model.zero_grad()
apply_tensor_parallel(tp_model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))["tp"], loss_parallel=False)
loss, logits = loss_of(tp_model, slice(None))
loss.backward()
res["tp_logits"] = (logits - alone).abs().max().item()
res["tp_grads"] = max((full(p.grad) - ref_grads[n]).abs().max().item() for n, p in tp_model.named_parameters())

# FSDP over both ranks: each rank trains on its own window; the reduce-scatter averages the gradients
fsdp_model = copy.deepcopy(ref)
fsdp_model.zero_grad()
dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
for block in fsdp_model.layers.values():
    fully_shard(block, mesh=dp_mesh)
fully_shard(fsdp_model, mesh=dp_mesh)
loss, logits = loss_of(fsdp_model, slice(rank, rank + 1))
loss.backward()
res["fsdp_logits"] = (logits - alone[rank : rank + 1]).abs().max().item()
res["fsdp_grads"] = max((full(p.grad) - ref_grads[n]).abs().max().item() for n, p in fsdp_model.named_parameters())
res["grad_scale"] = max(g.abs().max().item() for g in ref_grads.values())
res["params"] = [len(ref_grads), len(list(tp_model.parameters())), len(list(fsdp_model.parameters()))]
worst = torch.tensor([res["tp_logits"], res["tp_grads"], res["fsdp_logits"], res["fsdp_grads"]])
dist.all_reduce(worst, op=dist.ReduceOp.MAX)
res["tp_logits"], res["tp_grads"], res["fsdp_logits"], res["fsdp_grads"] = worst.tolist()
if rank == 0:
    (__import__("pathlib").Path(out) / "result.json").write_text(json.dumps(res))
dist.barrier()
dist.destroy_process_group()
from engine.parallel.launch import end_process
end_process(0)
"""


def test_packed_documents_under_tensor_parallel_and_fsdp(tmp_path, parity):
    """One launch of 2 processes checks both layouts against the single-process model: logits equal each
    document alone, gradients equal the single-process packed gradients (float64, parity.FP64_TOL)."""
    script = tmp_path / "packing_parallel.py"
    script.write_text(PARALLEL_SCRIPT)
    result = torchrun(script, 2, str(tmp_path), json.dumps(CFG), str(EOS), timeout=180)
    assert result.returncode == 0, result.stdout[-4000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["params"][0] == res["params"][1] == res["params"][2] > 0
    for key in ("alone_vs_ref", "tp_logits", "tp_grads", "fsdp_logits", "fsdp_grads"):
        parity.within(key, res[key], FP64_TOL)
    assert res["grad_scale"] > 1e-3, "the gradients should be far larger than the tolerance"


def saved_bytes(model: Transformer, tokens: torch.Tensor, doc_ids: torch.Tensor | None, forwards: int = 1) -> int:
    """Bytes of the distinct storages autograd saves for backward in `forwards` forwards whose graphs are all
    alive at once (a pipeline stage's micro-batches in flight)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outputs = [model(tokens, doc_ids=doc_ids) for _ in range(forwards)]
    assert len(outputs) == forwards
    return sum(seen.values())


def test_memory_estimate_counts_what_packing_saves():
    """The packing term on CPU (engine.parallel.memory.packing_bytes: SDPA's dense mask) equals the extra bytes
    autograd saves in a packed forward (fp32, SDPA's math kernel), as does the estimate for CUDA with heads
    of 8 (too small for FlexAttention); with heads of 16 CUDA counts FlexAttention's block mask instead: the
    bytes of the tensors `document_block_mask` builds (here on the CPU), for windows of one to four blocks."""
    from engine.config import load_job_config
    from engine.parallel.memory import estimate_memory, packing_bytes

    args = [f"--model.{k}={v}" for k, v in CFG.items()] + ["--train.seq_len=32", "--train.batch_size=4"]
    args += ["--train.mixed_precision=fp32"]
    plain, packed = (
        check_config(load_job_config(None, [*args, f"--data.pack_sequences={p}"])) for p in ("false", "true")
    )
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CFG))
    tokens = torch.randint(1, CFG["vocab_size"], (4, 32))
    tokens[:, 10] = EOS
    measured = saved_bytes(model, tokens, document_ids(tokens, EOS)) - saved_bytes(model, tokens, None)
    estimated = estimate_memory(packed, 1)[0].activations - estimate_memory(plain, 1)[0].activations
    assert estimated == packing_bytes(packed, "cpu") == measured > 0
    wide = packed.model_copy(update={"model": packed.model.model_copy(update={"n_heads": 2, "n_kv_heads": 1})})
    for batch, seq in [(4, 128), (2, 384), (3, 500)]:  # one block; three; a partial fourth
        shape = wide.model_copy(update={"train": wide.train.model_copy(update={"batch_size": batch, "seq_len": seq})})
        rope = 2 * 4 * (batch - 1) * seq * 16  # cos and sin [batch - 1 more, seq, head_dim] fp32
        ids = document_ids(
            torch.randint(1, CFG["vocab_size"], (batch, seq)).index_fill_(1, torch.tensor([99]), EOS), EOS
        )
        block_mask = document_block_mask(ids).as_tuple()  # what the CUDA path builds, here built on the CPU
        mask = sum(t.nbytes for t in block_mask if isinstance(t, torch.Tensor))
        assert sum(isinstance(t, torch.Tensor) for t in block_mask) >= 4 and mask > 0
        assert packing_bytes(shape, "cuda") == mask + rope, (batch, seq)
        if (batch, seq) == (4, 128):
            assert packing_bytes(shape, "cpu") == 2 * 4 * 4 * 128**2 + rope  # 2 blocks' additive fp32 masks


def test_memory_estimate_counts_each_pipeline_stage_s_packed_micro_batches():
    """Under pp = 2 (1F1B, 2 micro-batches) rank 0 holds both micro-batches' forwards through its stage at its
    peak and rank 1 one (`forward_chunks`): each micro-batch in flight keeps its own mask in every block and
    its own RoPE tables. Each rank's packing term (its estimate with packing minus without, fp32 on CPU)
    equals the extra bytes autograd saves in those forwards of its stage model, packed against plain."""
    from engine.config import load_job_config
    from engine.parallel.memory import estimate_memory
    from engine.parallel.pipeline import split_stages

    args = [f"--model.{k}={v}" for k, v in CFG.items()] + ["--train.seq_len=32", "--train.batch_size=4"]
    args += ["--train.mixed_precision=fp32", "--distributed.pp=2", "--train.grad_accum_steps=2"]
    args += ["--distributed.pp_schedule=1f1b"]
    plain, packed = (
        check_config(load_job_config(None, [*args, f"--data.pack_sequences={p}"]), 2) for p in ("false", "true")
    )
    rows = estimate_memory(packed, 2)
    assert [row.microbatches_in_flight for row in rows] == [2, 1]
    estimated = [ours.activations - theirs.activations for ours, theirs in zip(rows, estimate_memory(plain, 2))]
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CFG))
    tokens = torch.randint(1, CFG["vocab_size"], (4, 32))
    tokens[:, [5, 17]] = EOS
    ids = document_ids(tokens, EOS)
    inputs = [tokens, torch.randn(4, 32, CFG["dim"])]  # the first stage's token ids, the last's hidden states
    measured = []
    for rank, row in enumerate(rows):
        [(_, stage)] = split_stages(model, rank, 2, 1)
        n = row.microbatches_in_flight
        measured.append(saved_bytes(stage, inputs[rank], ids, n) - saved_bytes(stage, inputs[rank], None, n))
    assert estimated == measured and min(measured) > 0, (estimated, measured)
    assert estimated[0] > estimated[1], "two micro-batches' masks against one"


def test_flex_attention_path_equals_the_dense_mask_path(monkeypatch, parity):
    """The CUDA kernel choice (FlexAttention with a document block mask) computes what SDPA with the dense
    mask computes: forced onto the CPU, the model's logits on windows of 384 tokens (three 128-blocks, some
    wholly masked and skipped) with several documents, one split at a block edge, equal the dense path's
    (fp32, 1e-5), with grouped-query heads. Forward only: PyTorch's FlexAttention has no backward on CPU
    (NotImplementedError in torch 2.13), so the gradients are left to the GPU (not measured here)."""
    from torch.nn.attention.flex_attention import BlockMask

    from engine.model import packed_kernel

    choose = packed_kernel.packed_attention_backend
    assert choose("cuda", 64, 2048) == "flex" and choose("cpu", 64, 2048) == choose("mps", 64, 2048) == "sdpa"
    assert choose("cuda", 8, 2048) == choose("cuda", 64, 64) == "sdpa"  # heads under 16, windows under a block
    cfg = ModelConfig(**{**CFG, "dim": 64, "max_seq_len": 384})  # 4 heads of 16
    torch.manual_seed(0)
    model = Transformer(cfg)
    windows = torch.stack([torch.cat(documents_of([100, 28, 150, 106], seed=s)) for s in range(2)])
    ids = document_ids(windows, EOS)
    assert ids.max() == 3
    with torch.no_grad():
        dense = model(windows, doc_ids=ids)
        seen = []
        hook = model.layers["0"].attention.core.register_forward_hook(lambda mod, args, out: seen.append(args[3]))
        monkeypatch.setitem(packed_kernel.PACKED_ATTENTION, "cpu", "flex")
        flex = model(windows, doc_ids=ids)
        hook.remove()
    assert len(seen) == 1 and isinstance(seen[0], BlockMask), "the flex path ran"
    # blocks each query block reads (partial + full): [1, 2, 3] causally; the documents (0-99, 100-127,
    # 128-277, 278-383) leave [1, 1, 2]: the third document's queries never read the first block
    visited = seen[0].kv_num_blocks + seen[0].full_kv_num_blocks
    assert visited.shape == (2, 1, 3) and visited[:, 0].tolist() == [[1, 1, 2]] * 2
    # fp32 (flex attention compiles): the kernels order the sums differently, parity.model_bound
    parity.close(flex, dense, atol=model_bound(cfg, dense.abs().max().item()), what="flex against dense logits")
    assert (model(windows) - dense).abs().max() > 1e-2, "the documents' mask matters on these windows"


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_packing_under_activation_checkpointing(mode, parity):
    """The recomputed blocks get the same document mask: logits and gradients as without checkpointing
    (float64, the same function)."""
    from engine.parallel.activation_checkpoint import apply_activation_checkpointing

    torch.manual_seed(0)
    plain = Transformer(ModelConfig(**CFG)).double()
    wrapped = Transformer(ModelConfig(**CFG)).double()
    wrapped.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(wrapped, mode)
    tokens = torch.cat([torch.cat(documents_of([5, 7, 4], seed=s))[None] for s in range(2)])
    ids = document_ids(tokens, EOS)
    outputs = []
    for model in (plain, wrapped):
        logits = model(tokens, doc_ids=ids)
        logits.square().mean().backward()
        outputs.append((logits.detach(), [p.grad for p in model.parameters()]))
    parity.close(outputs[1][0], outputs[0][0], atol=FP64_TOL, what="logits")
    assert len(outputs[0][1]) == len(outputs[1][1]) > 0
    parity.close(outputs[1][1], outputs[0][1], atol=FP64_TOL, what="gradients")


def test_packing_is_accepted_under_pipeline_and_context_parallelism():
    """Pipeline parallelism passes the document ids to every stage, context parallelism's attention cores
    mask by document (tests/parallel/test_context_parallel.py): both layouts validate with packing on and off."""
    from engine.config import load_job_config

    for layout in (["--distributed.pp=2", "--train.grad_accum_steps=2"], ["--distributed.cp=2"]):
        for packed in ("true", "false"):
            check_config(load_job_config(None, [f"--data.pack_sequences={packed}", *layout]), world_size=2)


@pytest.mark.parametrize("mode", ["none", "full"])
def test_the_boolean_mask_outlives_the_forward_only_under_checkpointing(mode):
    """What memory.packing_bytes adds under activation checkpointing: the [batch, 1, seq, seq] boolean mask
    stays alive after the forward (the checkpoints hold it to recompute their blocks), once per forward, and
    is freed by backward; without checkpointing only SDPA's own additive copies are kept (measured as saved
    tensors in test_memory_estimate_counts_what_packing_saves), and the boolean mask dies with the forward."""
    import weakref

    from engine.config import load_job_config
    from engine.parallel.activation_checkpoint import apply_activation_checkpointing
    from engine.parallel.memory import packing_bytes

    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CFG))
    if mode != "none":
        apply_activation_checkpointing(model, mode)
    masks: list[weakref.ref] = []
    model.layers["0"].attention.core.register_forward_pre_hook(lambda _m, args: masks.append(weakref.ref(args[3])))
    tokens = torch.cat([torch.cat(documents_of([5, 7, 4, 16], seed=s))[None] for s in range(2)])
    logits = model(tokens, doc_ids=document_ids(tokens, EOS))
    assert len(masks) == 1
    held = masks[0]() is not None
    assert held == (mode != "none")
    logits.square().mean().backward()
    assert masks[-1]() is None  # backward let go of it
    args = [f"--model.{k}={v}" for k, v in CFG.items()] + ["--train.seq_len=32", "--train.batch_size=2"]
    args += ["--train.mixed_precision=fp32", f"--train.activation_checkpointing={mode}"]
    cfg = check_config(load_job_config(None, [*args, "--data.pack_sequences=true"]))
    rope = 2 * 4 * (2 - 1) * 32 * 8
    blocks = 2 if mode == "none" else 1  # additive fp32 masks kept: every block's, or the one being recomputed
    assert packing_bytes(cfg, "cpu") == blocks * 4 * 2 * 32**2 + (2 * 32**2 if held else 0) + rope
