"""Tiny models, their run folders and exports for the checks against Hugging Face `transformers`, and `forge` invoked in-process (typer's CliRunner)."""

from __future__ import annotations

import copy
import re
import types
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from engine.checkpoint.dcp import save_checkpoint
from engine.config import JobConfig, dump_toml
from engine.config.model import ModelConfig
from engine.generate import Sampling, generate
from engine.model.transformer import Transformer
from forgecli.app import app
from tests.helpers.data_fixtures import tokenizer_file
from tests.helpers.parity import FP64_TOL, Parity, logits_tolerance

transformers = pytest.importorskip("transformers")


VOCAB = 151


def model_config(**shape) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, max_seq_len=64, **shape)


def random_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """Weights scaled up from the init (sharp distributions, so greedy decoding has no near-ties) and
    norm weights away from 1, so every tensor's mapping matters."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(8)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def make_run(root: Path, model: Transformer, with_tokenizer: bool = False) -> Path:
    """A run directory as forge train leaves it: config.toml, a checkpoint, optionally tokenizer.json."""
    root.mkdir(parents=True)
    (root / "config.toml").write_text(dump_toml(JobConfig(model=model.cfg)))
    if with_tokenizer:
        tokenizer_file(root)
    save_checkpoint(root / "checkpoints", 5, model, torch.optim.AdamW(model.parameters()), {"step": 5})
    return root


def hf_model(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def no_leftovers(out: Path) -> bool:
    """Neither the output folder nor a temporary sibling of it exists."""
    return not out.exists() and not list(out.parent.glob(f".{out.name}.*"))


def rms_norm_at_input_precision(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm formula (weight · x / √(mean x² + ε)) in its input's dtype: theirs casts the input
    to float32 whatever it is, an upcast meant for half precision that for float64 is a downcast."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def in_float64(hf):
    """A copy of transformers' model computing in float64: `.double()`, and its RMSNorms (Llama's, Qwen's,
    Mistral's: every module with a `variance_epsilon`) at their input's precision, which would otherwise round
    every normed activation to fp32. What stays fp32 is the RoPE tables, on both sides and by the same products
    p·ω (transformers computes them in fp32 for any model dtype; Forge's are fp32 buffers): equal entries, so
    the two float64 models compute the same function and agree within parity.FP64_TOL."""
    hf = copy.deepcopy(hf).double()
    for module in hf.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(rms_norm_at_input_precision, module)
    return hf


def assert_same_logits(parity: Parity, hf, model, tokens: torch.Tensor) -> None:
    """transformers' logits against Forge's on `tokens`. In float64 (`in_float64`; the claim is that both compute
    the same function: within parity.FP64_TOL), except for a mixture of experts, which cannot run in float64
    (grouped_mm has no float64 kernel, and transformers' routers compute their weights in fp32): in fp32 as
    exported, within parity.logits_tolerance (the statistical rounding bound of the forward's sizes)."""
    with torch.no_grad():
        if model.cfg.num_experts:
            ours = model(tokens)
            tolerance = logits_tolerance(model.cfg, tokens.shape[1], ours.abs().max().item())
            parity.close(hf(tokens).logits, ours, atol=tolerance, what="fp32 logits")
        else:
            ours = copy.deepcopy(model).double()(tokens)
            parity.close(in_float64(hf)(tokens).logits, ours, atol=FP64_TOL, what="float64 logits")


def assert_same_as_transformers(parity: Parity, hf, model, *, seq: int, prompt: int, new_tokens: int) -> None:
    """Same logits on random tokens (`assert_same_logits`) and, in fp32 as exported, the same greedy
    continuation of a prompt."""
    tokens = torch.randint(0, VOCAB, (2, seq))
    assert_same_logits(parity, hf, model, tokens)
    start = tokens[:1, :prompt]
    theirs = hf.generate(
        start,
        attention_mask=torch.ones_like(start),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, prompt:].tolist()
    assert list(generate(model, start[0].tolist(), new_tokens, Sampling(temperature=0))) == theirs


def said(result) -> str:
    """The error panel's text on one line (Rich wraps long messages inside the box)."""
    return " ".join(re.sub("[│╭╮╰╯─]", " ", result.stderr).split())


def forge(*args: str):
    return CliRunner().invoke(app, list(args), env={"NO_COLOR": "1", "COLUMNS": "200"})
