"""Sampling with a KV cache: the cache changes nothing but speed, sampling options do what they say, and
`forge generate` works end to end on a tiny trained run, deterministically with a seed."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from engine.config.model import ModelConfig
from engine.errors import UserError
from engine.generate import Sampling, generate, next_token
from engine.model.transformer import Transformer
from forgecli.app import app
from tests.helpers.data_fixtures import job_config, tokenized
from tests.helpers.parity import FP64_TOL

SHAPES = [
    dict(dim=64, n_layers=2, n_heads=4),
    dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, qk_norm=True, tie_embeddings=True),
    dict(dim=32, n_layers=1, n_heads=4, n_kv_heads=1, rope_theta=500000.0),
]


def random_model(shape: dict, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(vocab_size=101, max_seq_len=48, **shape)).eval()
    with torch.no_grad():
        for p in model.parameters():  # larger weights than the init: sharper, less tie-prone distributions
            if p.ndim > 1:
                p.mul_(8)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@torch.no_grad()
def greedy_without_cache(model: Transformer, prompt: list[int], steps: int) -> list[int]:
    """The reference: re-run the whole sequence for every new token."""
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("shape", SHAPES)
def test_cached_greedy_generation_equals_full_recompute(shape):
    model = random_model(shape)
    prompt = torch.randint(0, 101, (7,)).tolist()
    cached = list(generate(model, prompt, 30, Sampling(temperature=0)))
    assert cached == greedy_without_cache(model, prompt, 30)


@pytest.mark.parametrize("shape", SHAPES)
@torch.no_grad()
def test_cache_in_chunks_gives_the_full_sequence_logits(shape, parity):
    """Prefill at 0, then a chunk of several positions (the masked path), then single tokens (float64: the
    same function over another split of the sequence)."""
    model = random_model(shape).double()
    tokens = torch.randint(0, 101, (2, 20))
    full = model(tokens)
    cache = model.new_kv_cache(batch=2, capacity=20)
    pieces = [model(tokens[:, :5], cache), model(tokens[:, 5:12], cache)]
    pieces += [model(tokens[:, i : i + 1], cache) for i in range(12, 20)]
    assert cache.length == 20
    parity.close(torch.cat(pieces, dim=1), full, atol=FP64_TOL, what="logits")


def test_forward_without_cache_is_unchanged_by_an_empty_cache():
    model = random_model(SHAPES[1])
    tokens = torch.randint(0, 101, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(tokens), model(tokens, model.new_kv_cache(batch=2, capacity=16)))


def test_cache_refuses_to_overflow():
    model = random_model(SHAPES[0])
    cache = model.new_kv_cache(batch=1, capacity=4)
    with pytest.raises(ValueError, match="exceed"):
        model(torch.zeros(1, 5, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.new_kv_cache(batch=1, capacity=49)


def test_sampling_options():
    torch.manual_seed(0)
    logits = torch.randn(50)

    def draw(sampling, seed=0):
        return next_token(logits, sampling, torch.Generator().manual_seed(seed))

    greedy = int(logits.argmax())
    assert draw(Sampling(temperature=0)) == greedy
    assert all(draw(Sampling(temperature=1.0, top_k=1), seed) == greedy for seed in range(5))
    assert all(draw(Sampling(temperature=1.0, top_p=1e-6), seed) == greedy for seed in range(5))
    top3 = set(torch.topk(logits, 3).indices.tolist())
    assert {draw(Sampling(temperature=2.0, top_k=3), seed) for seed in range(40)} <= top3
    probs = torch.softmax(logits, -1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())  # smallest set reaching 0.5
    assert {draw(Sampling(temperature=1.0, top_p=0.5), seed) for seed in range(40)} <= nucleus


def test_seed_makes_sampling_reproducible():
    model = random_model(SHAPES[0])

    def sample(seed):
        return list(generate(model, [1, 2, 3], 20, Sampling(temperature=1.0, seed=seed)))

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(temperature=-1), "--temperature"),
        (dict(top_k=-2), "--top-k"),
        (dict(top_p=0.0), "--top-p"),
        (dict(top_p=1.5), "--top-p"),
    ],
)
def test_bad_sampling_options_are_user_errors(kwargs, needle):
    with pytest.raises(UserError, match=needle):
        Sampling(**kwargs)


def test_prompt_plus_new_tokens_must_fit_the_context():
    model = random_model(SHAPES[0])  # max_seq_len 48
    with pytest.raises(UserError, match="context of 48 tokens") as err:
        list(generate(model, list(range(10)), 39, Sampling(temperature=0)))
    assert err.value.hint == "use --max-new-tokens 38 or less"
    assert len(list(generate(model, list(range(10)), 38, Sampling(temperature=0)))) == 38


def test_generation_stops_at_a_stop_token():
    model = random_model(SHAPES[0])
    free = list(generate(model, [5, 6], 20, Sampling(temperature=0)))
    stopped = list(generate(model, [5, 6], 20, Sampling(temperature=0), stop_ids=[free[3]]))
    assert stopped == free[: free.index(free[3]) + 1]


# ------------------------------------------------------------------ the CLI on a tiny trained run


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    from engine.train.trainer import train

    tmp = tmp_path_factory.mktemp("generate")
    cfg = job_config(
        tokenized(tmp),
        "model.dim=64",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.max_seq_len=64",
        "train.seq_len=32",
        "train.max_steps=8",
        "checkpoint.interval=4",  # two checkpoints, steps 4 and 8: the run directory must mean the newest
        "eval.enabled=false",
        "scheduler.warmup_steps=1",
        "optimizer.lr=3e-3",
    )
    train(cfg, tmp / "run")
    return tmp / "run"


def said(result) -> str:
    """The error panel's text on one line (Rich wraps long messages inside the box)."""
    return " ".join(re.sub("[│╭╮╰╯─]", " ", result.stderr).split())


def forge(*args: str, stdin: str | None = None):
    return CliRunner().invoke(app, list(args), input=stdin, env={"NO_COLOR": "1", "COLUMNS": "200"})


def test_forge_generate_streams_text_deterministically_with_a_seed(tiny_run):
    args = ["generate", str(tiny_run), "--prompt", "The", "--max-new-tokens", "20", "--seed", "3"]
    first, second = forge(*args), forge(*args)
    assert first.exit_code == 0, first.output
    assert first.stdout.startswith("The") and len(first.stdout.strip()) > len("The")
    assert first.stdout == second.stdout
    assert sorted(p.name for p in (tiny_run / "checkpoints").glob("step_*")) == ["step_4", "step_8"]
    older, newest = (forge("generate", str(tiny_run / "checkpoints" / f"step_{n}"), *args[2:]) for n in (4, 8))
    assert older.stdout != newest.stdout  # the two checkpoints tell apart which one was loaded
    assert first.stdout == newest.stdout  # the run directory means its newest checkpoint


def test_forge_generate_interactive_loop(tiny_run):
    result = forge(
        "generate", str(tiny_run), "--interactive", "-n", "5", "--temperature", "0", stdin="First\nSecond\n\n"
    )
    assert result.exit_code == 0, result.output
    # Two prompts answered, each with the greedy continuation of its own text; the empty line quits.
    alone = [
        forge("generate", str(tiny_run), "-p", p, "-n", "5", "--temperature", "0").stdout for p in ("First", "Second")
    ]
    assert alone[0].startswith("First") and alone[1].startswith("Second") and alone[0][5:] != alone[1][6:]
    assert result.stdout == f"prompt> {alone[0][5:]}prompt> {alone[1][6:]}prompt> "


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--max-new-tokens", "500"], "max_seq_len"),
        (["--top-p", "2"], "--top-p"),
    ],
)
def test_forge_generate_bad_flags_exit_2(tiny_run, args, needle):
    result = forge("generate", str(tiny_run), *args)
    assert result.exit_code == 2 and needle in said(result) and "Traceback" not in result.output
    assert result.stdout == ""


def test_forge_generate_needs_a_checkpoint_and_its_tokenizer(tmp_path, tiny_run):
    result = forge("generate", str(tmp_path))
    assert result.exit_code == 2 and "not a Forge run directory" in said(result)
    shutil.copytree(tiny_run, tmp_path / "run")
    (tmp_path / "run" / "tokenizer.json").unlink()
    result = forge("generate", str(tmp_path / "run"))
    assert result.exit_code == 2 and "has no tokenizer.json" in said(result)


def test_forge_generate_on_a_damaged_checkpoint_exits_2(tiny_run, tmp_path):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_run, damaged)
    for shard in damaged.glob("checkpoints/step_*/*.distcp"):
        shard.write_bytes(b"cut short")
    result = forge("generate", str(damaged), "--prompt", "The", "-n", "3")
    assert result.exit_code == 2 and "cannot load the weights" in said(result), result.output
    assert "Traceback" not in result.output


def test_transformers_continues_a_raw_text_prompt_of_the_export_like_forge_generate(tiny_run, tmp_path):
    """A transformers user prompts the `forge convert to-hf` export with raw text, `tok(text)`: the exported
    tokenizer starts it with the end-of-text token that precedes every training document, as forge generate
    starts a prompt, so the ids and the greedy continuation are forge generate's."""
    transformers = pytest.importorskip("transformers")
    from engine.checkpoint.hf import export_to_hf
    from engine.data.tokenizer import Encoder
    from engine.generate import prompt_ids

    run_tokenizer = (tiny_run / "tokenizer.json").read_bytes()
    export_to_hf(tiny_run, tmp_path / "hf")
    assert (tiny_run / "tokenizer.json").read_bytes() == run_tokenizer  # what training reads is left alone
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    encoder = Encoder.from_file(tiny_run / "tokenizer.json")
    for prompt in ("The", "ROMEO: what light"):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert ids[0].tolist() == prompt_ids(encoder, prompt) and ids[0, 0] == encoder.eos_id
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
        theirs = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        ours = forge("generate", str(tiny_run), "--prompt", prompt, "--max-new-tokens", "20", "--temperature", "0")
        assert ours.exit_code == 0, ours.output
        assert ours.stdout == prompt + theirs + "\n"
