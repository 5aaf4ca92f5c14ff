"""The model against references nobody here wrote: a plain re-implementation in this file and HF Llama."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config.model import ModelConfig
from engine.model.estimate import param_counts
from engine.model.transformer import Transformer
from tests.helpers.convert import assert_same_logits
from tests.helpers.parity import model_bound

SHAPES = [
    dict(dim=64, n_layers=2, n_heads=4),
    dict(dim=64, n_layers=3, n_heads=8, n_kv_heads=2, qk_norm=True),
    dict(dim=96, n_layers=2, n_heads=6, n_kv_heads=3, tie_embeddings=True, norm_type="layernorm"),
    dict(dim=48, n_layers=1, n_heads=2, ffn_hidden_dim=100, activation="gelu", rope_theta=500000.0, norm_eps=1e-6),
    dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=1, activation="relu", ffn_dim_multiplier=1.3),
]


def reference_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Straight from the equations, with explicit loops over heads and no SDPA, RMSNorm module or chunking."""
    cfg = model.cfg
    sd = {k: v.double() for k, v in model.state_dict().items()}
    act = {
        "silu": lambda x: x * torch.sigmoid(x),
        "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
        "relu": lambda x: x.clamp_min(0),
    }[cfg.activation]

    def norm(x, prefix):
        if cfg.norm_type == "rmsnorm":
            return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * sd[prefix + ".weight"]
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + cfg.norm_eps) * sd[prefix + ".weight"] + sd[prefix + ".bias"]

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w

    hd, T = cfg.head_dim, tokens.shape[1]
    pos = torch.arange(T, dtype=torch.float64)[:, None]
    freqs = cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos * freqs  # [T, hd/2]

    def rope(x):  # x [T, hd]; pairs (i, i + hd/2) rotate by ang[:, i]
        a, b = x[:, : hd // 2], x[:, hd // 2 :]
        return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], dim=-1)

    out = []
    for seq in tokens:
        h = sd["tok_embeddings.weight"][seq]
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            x = norm(h, p + "attention_norm")
            q, k, v = (x @ sd[p + f"attention.{w}.weight"].T for w in ("wq", "wk", "wv"))
            heads = []
            for head in range(cfg.n_heads):
                kv = head // (cfg.n_heads // cfg.kv_heads)
                qh, kh, vh = (
                    q[:, head * hd : (head + 1) * hd],
                    k[:, kv * hd : (kv + 1) * hd],
                    v[:, kv * hd : (kv + 1) * hd],
                )
                if cfg.qk_norm:
                    qh, kh = rms(qh, sd[p + "attention.q_norm.weight"]), rms(kh, sd[p + "attention.k_norm.weight"])
                scores = rope(qh) @ rope(kh).T / math.sqrt(hd)
                scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
                heads.append(scores.softmax(-1) @ vh)
            h = h + torch.cat(heads, -1) @ sd[p + "attention.wo.weight"].T
            x = norm(h, p + "ffn_norm")
            gate = act(x @ sd[p + "feed_forward.w1.weight"].T) * (x @ sd[p + "feed_forward.w3.weight"].T)
            h = h + gate @ sd[p + "feed_forward.w2.weight"].T
        head_w = sd["tok_embeddings.weight"] if cfg.tie_embeddings else sd["output.weight"]
        out.append(norm(h, "norm") @ head_w.T)
    return torch.stack(out)


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_match_plain_reference(shape, parity):
    """Our fp32 model against the equations in float64: within parity.model_bound (fp32 rounding of our
    reductions; the fp32 RoPE tables' angle error, ≤ U32 · position, is far below it)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, max_seq_len=32, **shape)
    model = Transformer(cfg)
    for p in model.parameters():  # norms start at 1/0; perturb them so their weights are exercised too
        if p.ndim == 1:
            p.data.add_(torch.randn_like(p) * 0.1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    ours = model(tokens)
    ref = reference_logits(model, tokens)
    parity.close(ours.double(), ref, atol=model_bound(cfg, ref.abs().max().item()), what="logits")


@pytest.mark.parametrize("shape", SHAPES)
def test_parameter_count_is_analytic(shape):
    cfg = ModelConfig(vocab_size=1000, **shape)
    assert Transformer(cfg).num_parameters() == param_counts(cfg)["total"]


def test_ffn_width_formula():
    assert ModelConfig(dim=4096, ffn_dim_multiplier=1.3).ffn_dim == 256 * math.ceil(8 / 3 * 4096 * 1.3 / 256)
    assert ModelConfig(dim=256).ffn_dim == 768
    assert ModelConfig(dim=256, ffn_hidden_dim=1000).ffn_dim == 1000


def test_depth_scaled_init():
    cfg = ModelConfig(dim=256, n_layers=8, n_heads=4, vocab_size=512, init_std=0.02)
    model = Transformer(cfg)
    wo = torch.cat([b.attention.wo.weight.flatten() for b in model.layers.values()])
    wq = torch.cat([b.attention.wq.weight.flatten() for b in model.layers.values()])
    assert wq.std().item() == pytest.approx(0.02, rel=0.05)
    assert wo.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


def test_tied_embeddings_share_storage():
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=50, tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight


def test_matches_transformers_llama(parity):
    """Same weights in transformers' LlamaForCausalLM give the same logits (RoPE layout, GQA, eps, theta)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = ModelConfig(
        dim=64,
        n_layers=2,
        n_heads=8,
        n_kv_heads=2,
        vocab_size=101,
        max_seq_len=64,
        rope_theta=50000.0,
        norm_eps=1e-6,
        ffn_hidden_dim=160,
    )
    model = Transformer(cfg)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=50000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    names = {
        "attention.wq": "self_attn.q_proj",
        "attention.wk": "self_attn.k_proj",
        "attention.wv": "self_attn.v_proj",
        "attention.wo": "self_attn.o_proj",
        "feed_forward.w1": "mlp.gate_proj",
        "feed_forward.w3": "mlp.up_proj",
        "feed_forward.w2": "mlp.down_proj",
        "attention_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    hf_sd = {
        "model.embed_tokens.weight": model.tok_embeddings.weight,
        "model.norm.weight": model.norm.weight,
        "lm_head.weight": model.output.weight,
    }
    for i in range(cfg.n_layers):
        for ours, theirs in names.items():
            hf_sd[f"model.layers.{i}.{theirs}.weight"] = model.state_dict()[f"layers.{i}.{ours}.weight"]
    hf.load_state_dict(hf_sd, strict=True)
    assert_same_logits(parity, hf, model, torch.randint(0, 101, (2, 40)))  # in float64, within FP64_TOL
