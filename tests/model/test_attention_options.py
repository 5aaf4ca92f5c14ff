"""Two attention options of the transformer family (issue 51): the gated attention output of Qwen3-Next
(`attention_output_gate`) and GPT-OSS's sink logits (`attention_sinks`).

Each against the `transformers` attention layer that has it, on the same weights in float64 (within
parity.FP64_TOL: the claim is that both compute the same function), through the layer mapping both ways
(engine/model/families/transformer/hf.py: Qwen3-Next's zero-centred QK-norm); generation through the KV cache
equal to the model without it; the torch-free shapes, FLOPs and saved activations equal to the model's; and the
refusals (exit 2, naming the fields). Their layouts (FSDP, TP, PP in float64) are in
tests/model/test_transformer_options.py's one launch (LAYOUT_MODELS)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine.errors import UserError
from engine.model.attention import Attention, sink_attention
from engine.model.families.transformer.hf import (
    GPT_OSS,
    QWEN3_NEXT,
    attention_state_for_hf,
    attention_state_from_hf,
)
from engine.model.rope import rope_tables
from engine.model.transformer import Transformer
from tests.helpers.convert import forge, make_run, model_config, no_leftovers, random_model, said
from tests.helpers.parity import FP64_TOL, U32, fp32_bound

transformers = pytest.importorskip("transformers")

GQA = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
SEQ, BATCH = 12, 2


def layer_inputs(cfg, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, SEQ, cfg.dim, generator=g, dtype=torch.float64)
    cos, sin = (t[:SEQ].to(torch.float64) for t in rope_tables(cfg))
    return x, cos, sin


def forge_attention(cfg, seed=0):
    """The attention of block 0 of a random model (weights away from the init: every tensor's mapping matters)."""
    return random_model(cfg, seed).to(torch.float64).layers["0"].attention.eval()


def causal_additive_mask(queries: int, keys: int, window: int | None = None) -> torch.Tensor:
    """The additive mask transformers' eager attention takes, [1, 1, q, k], written from the definition (not
    with Forge's sliding_window_mask): query i, at position keys − queries + i, sees key j when 0 ≤ its
    position − j < window."""
    mask = torch.full((queries, keys), float("-inf"), dtype=torch.float64)
    for i in range(queries):
        for j in range(keys):
            if 0 <= keys - queries + i - j < (window or keys):
                mask[i, j] = 0.0
    return mask[None, None]


def hf_layer(layer_cls, config, ours: Attention, architecture: str):
    config._attn_implementation = "eager"
    theirs = layer_cls(config, layer_idx=0).to(torch.float64).eval()
    missing, unexpected = theirs.load_state_dict(attention_state_for_hf(ours.state_dict(), architecture), strict=True)
    assert not missing and not unexpected
    return theirs


def qwen3_next_norm_tolerance(seen: dict, ours: Attention) -> float:
    """Qwen3NextRMSNorm computes in float32 whatever its input (`x.float()`), everything else being float64:
    each normed q and k element carries a relative error e ≤ (d/2 + 5)·U32 (the cast; the mean of d squares,
    summed in fp32, whose error the rsqrt halves; the rsqrt, x·rsqrt, the (1 + w) product and the cast back).
    A score q·k/√d then moves by at most 2e·|q||k|/√d, a softmax weight p_j by at most 2·p_j times the largest
    score change, the head's output by that times max|v|, the gate (< 1) shrinks it and wo adds up a row: the
    bound is 4e · max|q||k|/√d · max|v| · max_row Σ|wo|, from this layer's own tensors."""
    q, k, v = seen["q"], seen["k"], seen["v"]
    d = q.shape[-1]
    e = (d / 2 + 5) * U32
    scores = q.norm(dim=-1).max() * k.norm(dim=-1).max() / math.sqrt(d)
    return (4 * e * scores * v.abs().max() * ours.wo.weight.abs().sum(dim=1).max()).item()


def test_the_gated_attention_layer_is_qwen3_nexts(parity):
    """Forge's attention with the output gate (and QK-norm, GQA, RoPE) equals transformers' Qwen3NextAttention
    on the same weights, in float64 but for Qwen3-Next's QK-norm, which runs in float32 (the tolerance is that
    rounding's bound: `qwen3_next_norm_tolerance`); its tensors map back to Forge's bitwise."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention

    cfg = model_config(**GQA, qk_norm=True, attention_output_gate=True)
    ours = forge_attention(cfg)
    config = transformers.Qwen3NextConfig(
        hidden_size=cfg.dim,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.norm_eps,
        attention_bias=False,
        partial_rotary_factor=1.0,  # Forge rotates every pair of the head; the cos/sin given here are full width
    )
    theirs = hf_layer(Qwen3NextAttention, config, ours, QWEN3_NEXT)
    x, cos, sin = layer_inputs(cfg)
    seen = {}
    ours.core.register_forward_hook(lambda module, args, out: seen.update(q=args[0], k=args[1], v=args[2]))
    with torch.no_grad():
        expected, _ = theirs(
            x, (cos[None].expand(BATCH, -1, -1), sin[None].expand(BATCH, -1, -1)), causal_additive_mask(SEQ, SEQ)
        )
        actual = ours(x, cos, sin)
        ungated = Attention(cfg.model_copy(update={"attention_output_gate": False})).to(torch.float64)
    parity.close(
        actual, expected, atol=qwen3_next_norm_tolerance(seen, ours), what="gated attention vs Qwen3NextAttention"
    )
    back = attention_state_from_hf(theirs.state_dict(), QWEN3_NEXT)
    assert back.keys() == ours.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())
    # the gate matters: the same weights without it (wq's query rows only) compute something else
    with torch.no_grad():
        wq = ours.wq.weight.view(cfg.n_heads, 2, cfg.head_dim, cfg.dim)[:, 0].reshape(-1, cfg.dim)
        ungated.load_state_dict({**ours.state_dict(), "wq.weight": wq})
        assert (ungated(x, cos, sin) - actual).abs().max() > 1e-3


@pytest.mark.parametrize("window", [None, 5])
def test_the_sink_attention_layer_is_gpt_osss(parity, window):
    """Forge's attention with sinks (GQA, RoPE, with and without a sliding window) equals transformers'
    GptOssAttention (its eager kernel, the reference implementation of sinks) on the same weights, in
    float64; the tensors map back bitwise."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention

    cfg = model_config(**GQA, attention_sinks=True, sliding_window=window)
    ours = forge_attention(cfg)
    with torch.no_grad():
        ours.sinks.weight.copy_(torch.tensor([-1.0, 0.0, 1.5, 3.0]))  # from a small to a dominant share
    config = transformers.GptOssConfig(
        hidden_size=cfg.dim,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        attention_bias=False,
        sliding_window=window,
        layer_types=["sliding_attention" if window else "full_attention"] * 2,
        num_hidden_layers=2,
    )
    theirs = hf_layer(GptOssAttention, config, ours, GPT_OSS)
    x, cos, sin = layer_inputs(cfg)
    with torch.no_grad():
        half = cfg.head_dim // 2  # GPT-OSS's tables are one half of Forge's two equal halves
        tables = (cos[None, :, :half].expand(BATCH, -1, -1), sin[None, :, :half].expand(BATCH, -1, -1))
        expected, _ = theirs(x, tables, causal_additive_mask(SEQ, SEQ, window))
        actual = ours(x, cos, sin)
    parity.close(actual, expected, atol=FP64_TOL, what=f"sink attention (window {window}) vs GptOssAttention")
    back = attention_state_from_hf(theirs.state_dict(), GPT_OSS)
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())
    # GPT-OSS's default layer has an o_proj bias, which Forge's wo has not: refused, naming it
    with pytest.raises(UserError, match=r"o_proj\.bias"):
        attention_state_from_hf({**theirs.state_dict(), "o_proj.bias": torch.zeros(cfg.dim)}, GPT_OSS)
    # the sinks matter: at -inf they take nothing, and the layer is plain attention
    with torch.no_grad():
        ours.sinks.weight.fill_(-math.inf)
        plain = Attention(cfg.model_copy(update={"attention_sinks": False})).to(torch.float64)
        plain.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.startswith("sinks")})
        parity.close(ours(x, cos, sin), plain(x, cos, sin), atol=FP64_TOL, what="sinks at -inf vs none")
        assert (ours(x, cos, sin) - actual).abs().max() > 1e-3


def test_sink_attention_over_a_flex_block_mask_equals_the_eager_kernel(parity):
    """Packed windows on CUDA take FlexAttention, whose log-sum-exp gives the sink's share (the output times
    sigmoid(lse − sink)); FlexAttention's forward runs on CPU too, so the same mask pairs through both kernels
    are compared here in float64."""
    from engine.model.documents import document_block_mask, document_ids, document_mask, flex_document_attention

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 256, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 256, 16, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.tensor([-1.0, 0.0, 1.5, 3.0], dtype=torch.float64)
    tokens = torch.randint(1, 9, (2, 256), generator=g)
    tokens[0, 100] = tokens[1, 30] = tokens[1, 200] = 0
    doc_ids = document_ids(tokens, 0)
    flex = flex_document_attention(q, k, v, document_block_mask(doc_ids), sinks)
    eager = sink_attention(q, k, v, document_mask(doc_ids), False, sinks)
    parity.close(flex, eager, atol=FP64_TOL, what="flex vs eager sink attention")


@pytest.mark.parametrize(
    "fields",
    [
        dict(attention_output_gate=True, qk_norm=True),
        dict(attention_sinks=True),
        dict(attention_output_gate=True, attention_sinks=True, sliding_window=6, attention_qkv_bias=True),
    ],
    ids=["gate", "sinks", "both_window_bias"],
)
def test_generation_with_the_cache_equals_without(fields, parity):
    """Through the KV cache — a prompt of 8 at once, then 10 tokens one by one, past the window — every
    position's logits equal the model's own forward over the whole sequence, in float64."""
    cfg = model_config(**GQA, **fields)
    model = random_model(cfg).to(torch.float64).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 18), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = model(tokens)
        cache = model.new_kv_cache(2, 18)
        steps = [model(tokens[:, :8], cache)] + [model(tokens[:, i : i + 1], cache) for i in range(8, 18)]
    parity.close(torch.cat(steps, dim=1), whole, atol=FP64_TOL, what="cached vs whole-sequence logits")


@pytest.mark.parametrize(
    "fields",
    [
        dict(attention_output_gate=True),
        dict(attention_sinks=True, qk_norm=True),
        dict(attention_output_gate=True, attention_sinks=True, attention_qkv_bias=True, mtp_depth=1),
    ],
    ids=["gate", "sinks_qk_norm", "both_bias_mtp"],
)
def test_shapes_counts_and_flops_are_the_models(fields):
    """The torch-free parameter shapes (memory estimate, pipeline split, TP dims) and counts are the model's
    own; the FLOPs count wq's gate rows as a matmul: 6 · dim · attention_dim more per layer and token."""
    from engine.model.estimate import param_counts
    from engine.model.families.transformer.shapes import training_flops_per_token
    from engine.parallel.memory import param_specs

    cfg = model_config(**GQA, **fields)
    model = Transformer(cfg)
    assert [(s.name, s.shape) for s in param_specs(cfg)] == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert param_counts(cfg)["total"] == model.num_parameters()
    plain = cfg.model_copy(update={"attention_output_gate": False, "attention_sinks": False})
    layers = cfg.n_layers + cfg.mtp_depth
    gate = 6 * cfg.dim * cfg.attention_dim * (1 + cfg.attention_qkv_bias / cfg.dim) * layers
    extra = gate if cfg.attention_output_gate else 0
    assert training_flops_per_token(cfg, 32) - training_flops_per_token(plain, 32) == pytest.approx(extra)
    sinks = [s for s in param_specs(cfg) if s.name.endswith("sinks.weight")]
    assert all(s.shape == (cfg.n_heads,) and s.tp_dim == 0 for s in sinks) and len(sinks) == (
        layers if cfg.attention_sinks else 0
    )


BAD_CONFIGS = [
    (
        ["--model.attention_sinks=true", "--model.sdpa_backend=flash"],
        ["model.attention_sinks", "model.sdpa_backend = 'flash'", "no SDPA kernel takes a sink"],
    ),
    (
        ["--model.attention_sinks=true", "--model.sdpa_backend=efficient"],
        ["model.attention_sinks", "model.sdpa_backend = 'efficient'"],
    ),
    (
        ["--model.attention_sinks=true", "--model.sdpa_backend=math"],
        ["model.attention_sinks", "model.sdpa_backend = 'math'", "read by nothing"],
    ),
    (
        ["--model.attention_sinks=true", "--distributed.cp=2", "--distributed.dp_shard=1", "--world-size=2"],
        ["model.attention_sinks", "context parallelism (distributed.cp = 2) does not support attention sinks"],
    ),
    (
        ["--model.model_type=gpt2", "--model.attention_output_gate=true"],
        ["model.attention_output_gate", "model.model_type = 'gpt2' has no such setting"],
    ),
    (
        ["--model.model_type=gpt2", "--model.attention_sinks=true"],
        ["model.attention_sinks", "model.model_type = 'gpt2' has no such setting"],
    ),
]


@pytest.mark.parametrize("args, needles", BAD_CONFIGS)
def test_bad_attention_options_exit_2_naming_the_fields(args, needles):
    result = forge("validate-config", "presets/debug.toml", *args)
    assert result.exit_code == 2, result.output
    assert all(needle in said(result) for needle in needles), said(result)


@pytest.mark.parametrize("field", ["attention_output_gate", "attention_sinks"])
def test_export_refuses_what_no_transformers_class_computes(tmp_path, field):
    """No transformers class Forge exports to has the option in a model Forge can otherwise express: to-hf
    exits 2 naming the field and writes nothing."""
    run = make_run(tmp_path / "run", random_model(model_config(**GQA, qk_norm=True, **{field: True})))
    result = forge("convert", "to-hf", str(run), "--out", str(tmp_path / "hf"))
    assert result.exit_code == 2 and f"model.{field}" in said(result), said(result)
    assert no_leftovers(tmp_path / "hf")


TINY_RUN = [
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.qk_norm=true",
    "--model.attention_output_gate=true",
    "--model.attention_sinks=true",
    "--model.max_seq_len=32",
    "--train.seq_len=32",
    "--train.batch_size=2",
    "--metrics.log_interval=1",
    "--eval.enabled=false",
    "--scheduler.warmup_steps=1",
    "--scheduler.decay_steps=4",
    "--checkpoint.interval=3",
]


def logged(run_dir) -> list[tuple]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, lines) if "loss" in r]


def test_a_run_with_both_options_trains_from_the_cli_and_resumes_bitwise(tmp_path):
    """`forge train` as a user types it, both options on: 6 steps at once, and 3 then resumed to 6 from the
    run's own config.toml, log the same losses and gradient norms and end on the same weights, bitwise; the
    checkpoint holds every layer's gate rows and sinks."""
    from engine.checkpoint.dcp import latest_checkpoint, load_checkpoint
    from engine.config import load_job_config
    from engine.model import build_model

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    for run, steps in ((whole, 6), (parts, 3)):
        result = forge("train", "presets/debug.toml", *TINY_RUN, f"--train.max_steps={steps}", "--run-dir", str(run))
        assert result.exit_code == 0, result.output
    result = forge("train", str(parts / "config.toml"), "--train.max_steps=6", "--run-dir", str(parts))
    assert result.exit_code == 0, result.output
    assert [r[0] for r in logged(whole)] == [1, 2, 3, 4, 5, 6] and logged(parts) == logged(whole)
    states = []
    for run in (whole, parts):
        model = build_model(load_job_config(run / "config.toml").model)
        load_checkpoint(latest_checkpoint(run / "checkpoints")[1], model)
        states.append(model.state_dict())
    assert states[0].keys() == states[1].keys() and all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert states[0]["layers.1.attention.sinks.weight"].shape == (4,)
    assert states[0]["layers.1.attention.wq.weight"].shape == (2 * 64, 64)


def test_extracted_attention_weights_leave_the_sinks_share_out(parity):
    """`forge extract --attention` reads the core's inputs: with sinks the stored weights are the keys' share
    of each softmax (the sink's column left out), so weights × V is the sink kernel's output and each row
    sums to less than 1 (fp32, as extracted: one product over ≤ SEQ keys after a softmax, fp32_bound depth 2)."""
    from engine.interp.attention import AttentionCapture

    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, SEQ, 16, generator=g)
    k, v = (torch.randn(1, 2, SEQ, 16, generator=g) for _ in range(2))
    sinks = torch.tensor([-1.0, 0.0, 1.5, 3.0])
    capture = AttentionCapture(blocks=("layers.0",), heads=(0, 1, 2, 3), query_positions=(), seq_len=SEQ)
    caught = {}
    capture.catch("layers.0", (q, k, v, None, True, sinks), {}, caught)
    weights = caught["layers.0.attention.weights"][0]
    out = sink_attention(q, k, v, None, True, sinks)[0]
    bound = fp32_bound(v.abs().max().item(), SEQ, 2)
    parity.close(weights @ v[0].repeat_interleave(2, dim=0), out, atol=bound, what="weights × V")
    assert (weights.sum(-1) < 1 - 1e-3).all() and torch.all(torch.triu(weights, diagonal=1) == 0)
