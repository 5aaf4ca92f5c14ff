"""`forge eval --data` and `forge extract` on a model that is not Forge's transformer
(tests/helpers/toy_experts_family.py), its family registered in the process as a library user registers one,
with nothing in engine/eval/ or engine/interp/ edited for it.

The run: 4 training steps of the toy (fp32, one process). The references are the toy itself, built from the
checkpoint's weights here and run on the tokens the extraction recorded:
- `forge extract --layers blocks.1`: the residual stream after block 1 is the toy's own, at every position;
- `forge eval --data … --stride 16` (disjoint windows of its 16-token context): the loss is the toy's mean
  cross-entropy over the same windows (the start token first), with as many tokens and windows.
Both computations run in fp32 with other batch shapes, so they agree within tests/helpers/parity.py's fp32_bound:
the longest reduction is the vocabulary's (256) and a value passes about 9 reductions a block on its way.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from typer.testing import CliRunner

from engine.checkpoint.dcp import latest_checkpoint, load_checkpoint
from engine.config import load_job_config
from engine.config.registry import MODELS
from engine.interp.store import load_activations
from engine.train.trainer import train
from forgecli.app import app
from tests.conftest import REPO
from tests.helpers import toy_experts_family as toy
from tests.helpers.parity import fp32_bound

SEQ, TOKENS = 16, 64


@pytest.fixture
def toy_run(tmp_path):
    """A 4-step toy run, the family registered for the test only."""
    with MODELS.restored():
        toy.register()
        cfg = load_job_config(REPO / "presets" / "debug.toml", [
            f"--train.seq_len={SEQ}", f"--model.max_seq_len={SEQ}", "--train.batch_size=2", "--train.max_steps=4",
            "--eval.enabled=false", "--scheduler.warmup_steps=1", "--train.mixed_precision=fp32",
            "--model.num_experts=4", "--model.moe_top_k=1",
        ])  # fmt: skip
        cfg = cfg.model_copy(update={"model": toy.toy_config(vocab_size=cfg.model.vocab_size)})
        train(cfg, tmp_path / "run")
        yield tmp_path / "run", cfg.model


def forge(*args):
    result = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_the_toy_is_evaluated_and_extracted_as_it_computes(toy_run, tmp_path, parity):
    run, cfg = toy_run
    out = tmp_path / "extracted"
    forge("extract", run, "--layers", "blocks.1", "--data", "embedded:val", "--max-tokens", TOKENS, "--out", out)
    result = forge(
        "eval", run, "--data", "embedded:val", "--max-tokens", TOKENS, "--stride", SEQ, "--json", "--no-record"
    )
    measured = json.loads(result.stdout)["perplexity"]

    model = toy.ToyExpertsLM(cfg)
    step, path = latest_checkpoint(run / "checkpoints")
    assert step == 4
    load_checkpoint(path, model)
    model.eval()
    acts = load_activations(out)
    stream = torch.from_numpy(np.asarray(acts.tokens, dtype=np.int64))
    assert len(stream) == TOKENS

    after_block = []
    hook = model.blocks["1"].register_forward_hook(lambda _m, _a, output: after_block.append(output) and None)
    with torch.no_grad():
        model(stream.view(-1, SEQ))
    hook.remove()
    hidden = after_block[0].flatten(0, 1)
    bound = fp32_bound(hidden.abs().max().item(), cfg.vocab_size, 9 * cfg.n_layers + 2)
    parity.close(acts["blocks.1"].torch(), hidden, atol=bound, what="residual stream after block 1")

    # eval's windows: [start] + stream, window k feeding tokens 16k … 16k+15 and scored on 16k+1 … 16k+16
    tokens = torch.cat([torch.tensor([start_token(run)]), stream])
    windows = [tokens[k : k + SEQ + 1] for k in range(0, TOKENS, SEQ)]
    with torch.no_grad():
        logits = [model(w[None, :-1])[0] for w in windows]
    nll = sum(F.cross_entropy(z.double(), w[1:], reduction="sum").item() for z, w in zip(logits, windows))
    assert (measured["tokens"], measured["windows"], measured["stride"]) == (TOKENS, TOKENS // SEQ, SEQ)
    # a token's loss is logsumexp(logits) − its logit: off by at most twice a logit's bound
    scale = max(z.abs().max().item() for z in logits)
    bound = 2 * fp32_bound(scale, cfg.vocab_size, 9 * cfg.n_layers + 2)
    parity.within("eval loss per token", abs(measured["loss"] - nll / TOKENS), bound)


def start_token(run) -> int:
    """What precedes every document in Forge's data, and so the start eval puts first: the end-of-text token
    (the run's tokenizer adds no start token of its own)."""
    tokenizer = Tokenizer.from_file(str(run / "tokenizer.json"))
    assert tokenizer.encode("a").ids == tokenizer.encode("a", add_special_tokens=False).ids
    return tokenizer.token_to_id(json.loads((run / "tokenizer_config.json").read_text())["eos_token"])
