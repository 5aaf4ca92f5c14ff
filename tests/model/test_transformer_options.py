"""The Llama-family options of the transformer family (issue 30): `attention_head_dim` apart from dim /
n_heads, q/k/v biases (Qwen2), RoPE scaling (linear, Llama 3.1's llama3) and a sliding window (Mistral).

Each against `transformers` both ways — a Forge model exported and loaded by transformers, and a model with
transformers' own random weights imported — with the same logits (in float64 within parity.FP64_TOL, a mixture
of experts in fp32 within parity.logits_tolerance: tests/helpers/convert.py's assert_same_logits) and, through
generation's KV cache, the same greedy tokens; under FSDP, TP and PP (one launch, float64, for all the options
in one model and for linear RoPE scaling in another) the per-step losses of one process; and the refusals of
what cannot be computed or exported (exit 2, naming the fields)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.checkpoint.dcp import load_checkpoint
from engine.checkpoint.hf import export_to_hf, import_from_hf
from engine.config import load_job_config
from engine.config.model import ModelConfig
from engine.model.attention import sliding_window_mask
from engine.model.rope import SCALINGS
from engine.model.transformer import Transformer
from tests.helpers.convert import (
    VOCAB,
    assert_same_as_transformers,
    assert_same_logits,
    forge,
    hf_model,
    make_run,
    model_config,
    no_leftovers,
    random_model,
    said,
)
from tests.helpers.parity import FP64_TOL
from tests.helpers.torchrun import torchrun

transformers = pytest.importorskip("transformers")

GQA = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
# head_dim 16, base 10^4: wavelengths 2π·10^(i/2) = 6.3 … 19869 for i = 0 … 7; against an original context of
# 256 (low 1, high 4) i = 0-2 are kept (< 64), i = 3 blended (199), i = 4-7 divided (> 256): all three regimes.
LLAMA3 = dict(rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_seq_len=256)
# name → (the [model] fields, the transformers class that computes the same)
OPTIONS = {
    "head_dim": (dict(GQA, dim=48, attention_head_dim=16), "LlamaForCausalLM"),
    "rope_llama3": (dict(dim=32, n_layers=2, n_heads=2, **LLAMA3), "LlamaForCausalLM"),
    "sliding_window": (dict(GQA, sliding_window=6), "MistralForCausalLM"),
    "sliding_qkv_bias_head_dim": (
        dict(GQA, sliding_window=6, attention_qkv_bias=True, attention_head_dim=12),
        "Qwen2ForCausalLM",
    ),
    "sliding_qk_norm_llama3": (dict(GQA, n_heads=2, sliding_window=5, qk_norm=True, **LLAMA3), "Qwen3ForCausalLM"),
    "moe_qkv_bias_linear": (
        dict(GQA, num_experts=4, moe_top_k=2, attention_qkv_bias=True, rope_scaling="linear", rope_scaling_factor=2.0),
        "Qwen2MoeForCausalLM",
    ),
}
OPTION_FIELDS = (
    "head_dim",
    "attention_head_dim",
    "attention_qkv_bias",
    "rope_scaling",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_seq_len",
    "sliding_window",
    "qk_norm",
)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_transformers_computes_what_an_exported_model_does_and_it_imports_back(tmp_path, name, parity):
    """Forge → HF: the class of the option, the same logits and greedy tokens (a prompt of 8, 12 new tokens:
    the generation runs past the sliding windows, through both libraries' caches); → Forge again: the same
    [model] fields and bitwise the same logits."""
    fields, architecture = OPTIONS[name]
    model = random_model(model_config(**fields)).eval()
    export_to_hf(make_run(tmp_path / "run", model), tmp_path / "hf")
    hf = hf_model(tmp_path / "hf")
    assert type(hf).__name__ == architecture
    # Nothing extra that computes (Qwen2-MoE's gate of its zero-width shared expert multiplies 0).
    assert sum(p.numel() for n, p in hf.named_parameters() if "shared_expert_gate" not in n) == model.num_parameters()
    assert_same_as_transformers(parity, hf, model, seq=24, prompt=8, new_tokens=12)
    import_from_hf(tmp_path / "hf", tmp_path / "back")
    imported = load_job_config(tmp_path / "back" / "model.toml").model
    assert {f: getattr(imported, f) for f in OPTION_FIELDS} == {f: getattr(model.cfg, f) for f in OPTION_FIELDS}
    back = Transformer(imported).eval()
    load_checkpoint(tmp_path / "back" / "step_0", back)
    tokens = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        assert torch.equal(back(tokens), model(tokens))


def hf_configs() -> dict:
    """name → (a transformers config with the option, in transformers' own spelling; the Forge fields it means)."""
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64
    )
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    return {
        "llama_head_dim": (
            transformers.LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=12),
            dict(attention_head_dim=12),
        ),
        "llama_rope_llama3": (
            transformers.LlamaConfig(**common, num_attention_heads=2, rope_parameters=llama3),
            dict(rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_seq_len=256),
        ),
        "llama_rope_linear": (
            transformers.LlamaConfig(
                **common, num_attention_heads=4, rope_parameters={"rope_type": "linear", "factor": 3.0}
            ),
            dict(rope_scaling="linear", rope_scaling_factor=3.0),
        ),
        "qwen2_bias_window": (
            transformers.Qwen2Config(
                **common,
                num_attention_heads=4,
                num_key_value_heads=2,
                use_sliding_window=True,
                sliding_window=6,
                max_window_layers=0,
            ),
            dict(attention_qkv_bias=True, sliding_window=6),
        ),
        "mistral_window_head_dim": (
            transformers.MistralConfig(
                **common, num_attention_heads=4, num_key_value_heads=1, sliding_window=5, head_dim=16
            ),
            dict(sliding_window=5, attention_head_dim=16),
        ),
    }


@pytest.mark.parametrize("name", list(hf_configs()))
def test_transformers_random_models_import_with_the_same_logits(tmp_path, name, parity):
    """HF → Forge: a model transformers made (its init, then every weight and bias moved off it, so that
    each mapping matters) saved with save_pretrained, imported by `forge convert from-hf`: the [model]
    fields of the option, the same logits."""
    hf_cfg, expected = hf_configs()[name]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.1))
    hf.save_pretrained(tmp_path / "hf")
    result = forge("convert", "from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"))
    assert result.exit_code == 0, result.output
    cfg = load_job_config(tmp_path / "ckpt" / "model.toml").model
    assert {f: getattr(cfg, f) for f in expected} == expected
    model = Transformer(cfg).eval()
    load_checkpoint(tmp_path / "ckpt" / "step_0", model)
    assert model.num_parameters() == sum(p.numel() for p in hf.parameters())
    assert_same_logits(parity, hf, model, torch.randint(0, VOCAB, (2, 40)))


def test_llama3_scaling_keeps_blends_and_divides_and_the_window_is_a_band():
    """The llama3 case above reaches all three regimes (so the comparisons test each), and the band a sliding
    window of 3 leaves: each query sees itself and the 2 keys before it, also for queries at the end of a
    cache (4 queries over 6 keys: positions 2 … 5); it is the mask the attention core receives."""
    cfg = ModelConfig(**OPTIONS["rope_llama3"][0])
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    ratio = (SCALINGS["llama3"](cfg, inv_freq) / inv_freq).tolist()
    assert len(ratio) == 8
    assert ratio[:3] == [1.0] * 3 and ratio[4:] == pytest.approx([1 / 8] * 4) and 1 / 8 < ratio[3] < 1
    expected = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]]).bool()
    assert torch.equal(sliding_window_mask(4, 6, 3, torch.device("cpu")), expected)
    # The attention core gets the band as its mask (what hooks on it see: engine/interp/attention.py).
    model = Transformer(model_config(**GQA, sliding_window=3))
    seen = []
    model.layers["0"].attention.core.register_forward_hook(lambda mod, args, out: seen.append(args[3:]))
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, 6)))
    assert len(seen) == 1 and seen[0][1] is False and torch.equal(seen[0][0], sliding_window_mask(6, 6, 3, "cpu"))


LAYOUT_SCRIPT = """
import copy, functools, json, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from engine.config.model import ModelConfig
from engine.model.documents import document_ids
from engine.model.transformer import Transformer
from engine.parallel.apply import apply_fsdp
from engine.parallel.pipeline import StageShapes, build_pipeline
from engine.parallel.tp import apply_tensor_parallel
from engine.train.losses import cross_entropy

out, models = sys.argv[1], json.loads(sys.argv[2])
dist.init_process_group("gloo")
torch.set_default_dtype(torch.float64)  # one function computed two ways: compared to parity.FP64_TOL
rank, cpu = dist.get_rank(), torch.device("cpu")
MICRO, ROWS, STEPS, EOS = 2, 2, 3, 0


def batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        data = torch.randint(0, cfg.vocab_size, (MICRO * ROWS, SEQ + 1), generator=g)
        data = data.masked_fill(torch.rand(data.shape, generator=g, dtype=torch.float32) < 0.15, EOS)
        yield data[:, :-1], data[:, 1:]


def docs(x, packed):
    return document_ids(x, EOS) if packed else None


def full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def train(model, rows, packed, reduce=None):
    # The step's global batch is MICRO micro-batches of ROWS, each loss / MICRO (accumulated); a data-parallel
    # rank takes one of them whole, and FSDP averages the gradients (and the test the losses) over `reduce`.
    opt, losses = torch.optim.AdamW(model.parameters(), lr=1e-3), []
    for x, y in batches():
        total = torch.zeros(())
        for xi, yi in list(zip(x.split(ROWS), y.split(ROWS)))[rows]:
            loss = cross_entropy(model(xi, doc_ids=docs(xi, packed)), yi) / (1 if reduce else MICRO)
            loss.backward()
            total += full(loss)
        if reduce is not None:
            dist.all_reduce(total, op=dist.ReduceOp.AVG, group=reduce)
        opt.step(); opt.zero_grad()
        losses.append(total.item())
    return losses, {n: full(p) for n, p in model.named_parameters()}


reports = {}
for name, model_args in models.items():  # each model: its references and the three layouts
    cfg = ModelConfig(**model_args)  # read by batches() and the SEQ below
    SEQ = cfg.max_seq_len
    torch.manual_seed(0)
    base = Transformer(cfg)
    results = {}
    references = {packed: train(copy.deepcopy(base), slice(None), packed) for packed in (False, True)}
    results["packed_differs"] = min(abs(a - b) for a, b in zip(references[True][0], references[False][0]))

    # FSDP over 2 ranks, unpacked: each rank one micro-batch, the gradients averaged (so each loss / MICRO, summed).
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = copy.deepcopy(base)
    apply_fsdp(model, mesh, torch.float32)  # fp32 "compute": casts nothing, the model stays float64
    results["fsdp"] = train(model, slice(rank, rank + 1), False, reduce=mesh.get_group())

    # TP over 2 ranks (heads, q/k/v biases and the sequence split), packed documents: both micro-batches on each.
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = copy.deepcopy(base)
    apply_tensor_parallel(model, mesh, loss_parallel=False)
    results["tp"] = train(model, slice(None), True)

    # PP, two stages of one block (gpipe), packed documents: the schedule's MICRO micro-batches.
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    shapes = StageShapes(ROWS, SEQ, SEQ, cfg.dim, cfg.vocab_size, torch.float64, torch.float64)
    pipe = build_pipeline(copy.deepcopy(base), mesh, "gpipe", MICRO, cross_entropy, cpu, shapes)
    params = [p for part in pipe.model_parts for p in part.parameters()]
    opt, losses = torch.optim.AdamW(params, lr=1e-3), []
    for x, y in batches():
        losses.append(pipe.step_loss(pipe.step(x, y, docs(x, True)), cpu).item())
        opt.step(); opt.zero_grad()
    state = {n: p.detach() for part in pipe.model_parts for n, p in part.named_parameters()}
    gathered = [None] * 2
    dist.all_gather_object(gathered, state)
    results["pp"] = (losses, {n: p for s in gathered for n, p in s.items()})

    if rank == 0:
        report = reports[name] = {"packed_differs": results["packed_differs"]}
        for layout, packed in (("fsdp", False), ("tp", True), ("pp", True)):
            ref_losses, ref_weights = references[packed]
            losses, weights = results[layout]
            report[layout] = {
                "losses": losses,
                "ref_losses": ref_losses,
                "same_names": sorted(weights) == sorted(ref_weights),
                "weights": max((weights[n] - w).abs().max().item() for n, w in ref_weights.items()),
                "worst": max(ref_weights, key=lambda n: (weights[n] - ref_weights[n]).abs().max().item()),
            }
if rank == 0:
    (__import__("pathlib").Path(out) / "result.json").write_text(json.dumps(reports))
dist.barrier()
dist.destroy_process_group()
from engine.parallel.launch import end_process
end_process(0)
"""

# Every option at once: heads 12 wide (q: 48 ≠ dim 32), q/k/v biases, llama3 RoPE (head_dim 12, base 10^4:
# wavelengths 6.3, 29, 135, … against an original context of 64 (low 1, high 4): kept, blended, divided)
# and a window of 5 in sequences of 16.
LAYOUT_MODEL = dict(
    GQA,
    vocab_size=64,
    max_seq_len=16,
    attention_head_dim=12,
    attention_qkv_bias=True,
    rope_scaling="llama3",
    rope_scaling_factor=4.0,
    rope_original_max_seq_len=64,
    sliding_window=5,
)
LAYOUT_MODELS = {
    "all_options_llama3": LAYOUT_MODEL,
    # the other RoPE scaling: positions divided by 4 (0 … 3.75 in sequences of 16), the rest plain Llama
    "rope_linear": dict(GQA, vocab_size=64, max_seq_len=16, rope_scaling="linear", rope_scaling_factor=4.0),
    # issue 51's options (tests/model/test_attention_options.py): the gate sharded with wq's heads, the sinks by
    # head; weights drawn wider (init_std 0.1) so that attention, halved by the gates at init, moves the losses
    "gate_sinks_qk_norm": dict(
        GQA, vocab_size=64, max_seq_len=16, qk_norm=True, attention_output_gate=True, attention_sinks=True, init_std=0.1
    ),
}


def test_fsdp_tp_and_pp_train_the_options_like_one_process(tmp_path, parity):
    """One launch of 2 gloo ranks, float64, for each of LAYOUT_MODELS: FSDP (unpacked), TP and a 2-stage
    pipeline (both with packed documents, the sliding window inside each document) each take 3 AdamW steps;
    every step's loss and the final weights equal one process's on the same global batch within
    parity.FP64_TOL (the claim is that they compute the same function: tests/helpers/parity.py)."""
    script = tmp_path / "options_layouts.py"
    script.write_text(LAYOUT_SCRIPT)
    result = torchrun(script, 2, str(tmp_path), json.dumps(LAYOUT_MODELS), timeout=240)
    assert result.returncode == 0, result.stdout[-4000:]
    reports = json.loads((tmp_path / "result.json").read_text())
    assert sorted(reports) == sorted(LAYOUT_MODELS)
    for model, report in reports.items():
        assert report["packed_differs"] > 1e-4, model  # the packed runs' documents change the losses
        for name in ("fsdp", "tp", "pp"):
            row = report[name]
            assert len(row["losses"]) == len(row["ref_losses"]) == 3 and row["same_names"], (model, name)
            worst = max(abs(a - b) for a, b in zip(row["losses"], row["ref_losses"]))
            parity.within(f"{model} {name} losses", worst, FP64_TOL)
            parity.within(f"{model} {name} weights (worst: {row['worst']})", row["weights"], FP64_TOL)


@pytest.mark.parametrize("name", ["head_dim", "sliding_qkv_bias_head_dim"])
def test_parameter_shapes_and_counts_are_the_models(name):
    """The torch-free shapes (memory estimate, FLOPs, pipeline split) of q/k/v n_heads·head_dim wide, and
    their biases, are the model's own."""
    from engine.model.estimate import param_counts
    from engine.parallel.memory import param_specs

    cfg = model_config(**OPTIONS[name][0])
    model = Transformer(cfg)
    assert {s.name: s.shape for s in param_specs(cfg)} == {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert [s.name for s in param_specs(cfg)] == [n for n, _ in model.named_parameters()]
    assert param_counts(cfg)["total"] == model.num_parameters()


BAD_CONFIGS = [
    (
        ["--model.rope_scaling=llama3", "--model.rope_original_max_seq_len=64", "--model.rope_high_freq_factor=1"],
        ["model.rope_high_freq_factor", "must exceed model.rope_low_freq_factor (1.0)"],
    ),
    (["--model.rope_scaling=llama3"], ["model.rope_original_max_seq_len", "model.rope_scaling = 'llama3'"]),
    (
        ["--model.rope_scaling=linear", "--model.rope_low_freq_factor=2"],
        ["model.rope_low_freq_factor", "model.rope_scaling = 'linear' does not read it"],
    ),
    (["--model.rope_scaling_factor=4"], ["model.rope_scaling_factor", "model.rope_scaling = 'none'"]),
    (
        ["--model.sliding_window=8", "--distributed.cp=2", "--distributed.dp_shard=1", "--world-size=2"],
        ["model.sliding_window", "context parallelism (distributed.cp = 2) does not support sliding-window"],
    ),
    (
        ["--model.sliding_window=8", "--model.sdpa_backend=flash"],
        ["model.sliding_window", "model.sdpa_backend = 'flash'"],
    ),
    (
        ["--model.attention_qkv_bias=true", "--lora.enabled=true"],
        ["lora.target_modules", "layers.0.attention.wq", "model.attention_qkv_bias"],
    ),
    (["--model.attention_head_dim=15"], ["attention_head_dim = 15 must be even"]),
]


@pytest.mark.parametrize("args, needles", BAD_CONFIGS)
def test_bad_option_combinations_exit_2_naming_both(args, needles):
    result = forge("validate-config", "presets/debug.toml", *args)
    assert result.exit_code == 2, result.output
    assert all(needle in said(result) for needle in needles), said(result)


def test_what_transformers_cannot_compute_is_refused_both_ways(tmp_path):
    """to-hf: QK-norm with q/k/v biases (no class has both), a sliding window in an MoE model; from-hf: a
    Qwen2 whose window slides on some layers only. Each exits 2 naming the fields and writes nothing."""
    for fields, needles in [
        (dict(GQA, qk_norm=True, attention_qkv_bias=True), ["model.qk_norm", "model.attention_qkv_bias"]),
        (dict(GQA, num_experts=2, moe_top_k=1, sliding_window=4), ["model.sliding_window", "model.num_experts"]),
    ]:
        run = make_run(tmp_path / f"run{len(fields)}", random_model(model_config(**fields)))
        result = forge("convert", "to-hf", str(run), "--out", str(tmp_path / "hf"))
        assert result.exit_code == 2 and all(n in said(result) for n in needles), said(result)
        assert no_leftovers(tmp_path / "hf")
    partly = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
    )
    transformers.Qwen2ForCausalLM(partly).save_pretrained(tmp_path / "qwen2")
    result = forge("convert", "from-hf", str(tmp_path / "qwen2"), "--out", str(tmp_path / "out"))
    assert result.exit_code == 2 and "some layers only (1 of 2" in said(result), said(result)
    assert no_leftovers(tmp_path / "out")


def test_the_flex_attention_mask_holds_the_window():
    """Packed documents on CUDA take FlexAttention with a block mask whose mask function holds the window
    itself (attention adds the band only to dense masks): evaluated at every (query, key) pair of two packed
    windows, it allows exactly the dense path's pairs, document mask and band together, and the window
    removes pairs the documents allowed. (The FlexAttention kernel against the dense path: tests/data/test_packing.py.)"""
    from engine.model.documents import document_mask, document_mask_mod

    doc_ids = torch.tensor([[0] * 9 + [1] * 3 + [2] * 8, [0] * 20])
    batch, seq = doc_ids.shape
    b, q, kv = torch.arange(batch)[:, None, None], torch.arange(seq)[None, :, None], torch.arange(seq)[None, None, :]
    flex = document_mask_mod(doc_ids, 4)(b, 0, q, kv)
    dense = document_mask(doc_ids)[:, 0] & sliding_window_mask(seq, seq, 4, "cpu")
    assert flex.shape == dense.shape == (2, 20, 20) and torch.equal(flex, dense)
    unwindowed = document_mask_mod(doc_ids)(b, 0, q, kv)
    assert torch.equal(unwindowed, document_mask(doc_ids)[:, 0]) and (unwindowed & ~flex).any()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_memory_estimate_counts_the_windows_mask_exactly(precision):
    """What a sliding window adds to the estimate (each block's SDPA keeps the additive [seq, seq] mask it
    makes of the band, in the compute dtype) is what it adds to the tensors autograd saves, byte for byte
    (the whole comparison, within 5 %: tests/parallel/test_memory_estimate.py)."""
    from engine.parallel.memory import estimate_memory
    from tests.helpers.memory import job, saved_activation_bytes

    plain, windowed = (
        job({"n_kv_heads": 4, "sdpa_backend": "auto", **extra}, train={"mixed_precision": precision})
        for extra in ({}, {"sliding_window": 8})
    )
    estimated = estimate_memory(windowed, 1)[0].activations - estimate_memory(plain, 1)[0].activations
    measured = saved_activation_bytes(windowed) - saved_activation_bytes(plain)
    seq, blocks, compute = plain.train.seq_len, plain.model.n_layers, 4 if precision == "fp32" else 2
    assert estimated == measured == blocks * compute * seq**2
