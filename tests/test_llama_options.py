"""The Llama-family options of the transformer family (issue 30): `attention_head_dim` apart from dim /
n_heads, q/k/v biases (Qwen2), RoPE scaling (linear, Llama 3.1's llama3) and a sliding window (Mistral).

Each against `transformers` both ways — a Forge model exported and loaded by transformers, and a model with
transformers' own random weights imported — with the same logits within parity.model_bound and, through
generation's KV cache, the same greedy tokens; under FSDP, TP and PP (one launch, float64) the per-step losses
of one process; and the refusals of what cannot be computed or exported (exit 2, naming the fields)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.checkpoint.dcp import load_checkpoint
from engine.checkpoint.hf import export_to_hf, import_from_hf
from engine.config import JobConfig, load_job_config
from engine.config.model import ModelConfig
from engine.model.attention import sliding_window_mask
from engine.model.rope import SCALINGS
from engine.model.transformer import Transformer
from tests.parity import FP64_TOL, Parity, model_bound
from tests.test_convert import (
    VOCAB,
    assert_same_as_transformers,
    forge,
    hf_model,
    make_run,
    model_config,
    no_leftovers,
    random_model,
    said,
)
from tests.torchrun import torchrun

transformers = pytest.importorskip("transformers")

GQA = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
# head_dim 16, base 10^4: wavelengths 2π·10^(i/2) = 6.3 … 19869 for i = 0 … 7; against an original context of
# 256 (low 1, high 4) i = 0-2 are kept (< 64), i = 3 blended (199), i = 4-7 divided (> 256): all three regimes.
LLAMA3 = dict(rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_seq_len=256)
# name → (the [model] fields, the transformers class that computes the same)
OPTIONS = {
    "head_dim": (dict(GQA, dim=48, attention_head_dim=16), "LlamaForCausalLM"),
    "qkv_bias": (dict(GQA, attention_qkv_bias=True), "Qwen2ForCausalLM"),
    "rope_llama3": (dict(dim=32, n_layers=2, n_heads=2, **LLAMA3), "LlamaForCausalLM"),
    "rope_linear": (dict(GQA, rope_scaling="linear", rope_scaling_factor=4.0), "LlamaForCausalLM"),
    "sliding_window": (dict(GQA, sliding_window=6), "MistralForCausalLM"),
    "sliding_qkv_bias_head_dim": (
        dict(GQA, sliding_window=6, attention_qkv_bias=True, attention_head_dim=12),
        "Qwen2ForCausalLM",
    ),
    "sliding_qk_norm_llama3": (dict(GQA, n_heads=2, sliding_window=5, qk_norm=True, **LLAMA3), "Qwen3ForCausalLM"),
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
    """Forge → HF: the class of the option, the same logits and greedy tokens (a prompt of 8, 24 new tokens:
    the generation runs far past the sliding windows, through both libraries' caches); → Forge again: the same
    [model] fields and bitwise the same logits."""
    fields, architecture = OPTIONS[name]
    model = random_model(model_config(**fields)).eval()
    export_to_hf(make_run(tmp_path / "run", model), tmp_path / "hf")
    hf = hf_model(tmp_path / "hf")
    assert type(hf).__name__ == architecture
    assert sum(p.numel() for p in hf.parameters()) == model.num_parameters()
    assert_same_as_transformers(parity, hf, model, seq=40, prompt=8, new_tokens=24)
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
    tokens = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        ours = model(tokens)
        parity.close(hf(tokens).logits, ours, atol=model_bound(cfg, ours.abs().max().item()), what="logits")


def test_llama3_scaling_keeps_blends_and_divides_and_the_window_is_a_band():
    """The llama3 case above reaches all three regimes (so the comparisons test each), and the band a sliding
    window of 3 leaves: each query sees itself and the 2 keys before it, also for queries at the end of a
    cache (4 queries over 6 keys: positions 2 … 5)."""
    cfg = ModelConfig(**OPTIONS["rope_llama3"][0])
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    ratio = (SCALINGS["llama3"](cfg, inv_freq) / inv_freq).tolist()
    assert len(ratio) == 8
    assert ratio[:3] == [1.0] * 3 and ratio[4:] == pytest.approx([1 / 8] * 4) and 1 / 8 < ratio[3] < 1
    expected = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]]).bool()
    assert torch.equal(sliding_window_mask(4, 6, 3, torch.device("cpu")), expected)
