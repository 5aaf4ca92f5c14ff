"""Tiny models, their run folders and exports for the checks against Hugging Face `transformers`, and `forge` invoked in-process (typer's CliRunner)."""

from __future__ import annotations

import re
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
from tests.helpers.parity import Parity, model_bound

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


def assert_same_as_transformers(parity: Parity, hf, model, *, seq: int, prompt: int, new_tokens: int) -> None:
    """Same logits on random tokens (fp32, as exported: within parity.model_bound, the two libraries ordering
    their sums differently) and the same greedy continuation of a prompt."""
    tokens = torch.randint(0, VOCAB, (2, seq))
    with torch.no_grad():
        ours = model(tokens)
        parity.close(hf(tokens).logits, ours, atol=model_bound(model.cfg, ours.abs().max().item()), what="logits")
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
