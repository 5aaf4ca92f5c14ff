"""`forge extract` (engine/interp): the stored residual stream equals Hugging Face `transformers`' hidden
states of the exported model, attention weights reproduce SDPA's output, the forward stops at the deepest
requested module, bf16 and `.npz` round-trip exactly, a SIGKILLed extraction resumes byte-identical, two
processes write what one writes (from a checkpoint saved under FSDP), and bad input exits 2 writing nothing."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from engine.checkpoint.hf import export_to_hf
from engine.config import JobConfig, dump_toml
from engine.config.model import ModelConfig
from engine.data.embedded import embedded_corpus
from engine.data.shards import open_shard, read_manifest
from engine.data.tokenize import tokenize_files
from engine.interp import load_activations
from engine.interp.extract import Extraction, ExtractRequest
from forgecli.app import app
from tests.conftest import REPO
from tests.helpers.convert import hf_model, make_run, random_model
from tests.helpers.data_fixtures import corpus_texts, tokenizer_file, write_jsonl
from tests.helpers.parity import fp32_bound, model_bound
from tests.helpers.torchrun import torchrun

transformers = pytest.importorskip("transformers")

SHAPE = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, norm_eps=1e-6, rope_theta=10000.0)
SEQ = 32


def cfg() -> ModelConfig:
    return ModelConfig(vocab_size=400, max_seq_len=SEQ, **SHAPE)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A run directory with a checkpoint and the tokenizer, its `forge convert to-hf` export, and some text."""
    root = tmp_path_factory.mktemp("extract")
    run = make_run(root / "run", random_model(cfg()).eval(), with_tokenizer=True)
    export_to_hf(run, root / "hf")
    data = write_jsonl(root / "docs.jsonl", corpus_texts(8, 150))
    return root, run, data


def forge(*args: str):
    result = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    result.said = " ".join(result.output.replace("│", " ").split())  # the panel's text, unwrapped
    return result


def extract_cli(run: Path, out: Path, *args: str) -> None:
    result = forge("extract", run, "--out", out, *args)
    assert result.exit_code == 0, result.output


def read_dir(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_residual_stream_and_attention_equal_transformers_and_sdpa(setup, tmp_path, parity):
    """fp32 (as extracted): transformers' hidden states within parity.model_bound; the attention weights
    against SDPA's output (one product over ≤ SEQ keys after a softmax: fp32_bound of depth 2)."""
    root, run, data = setup
    out = tmp_path / "acts"
    extract_cli(run, out, "--layers", "layers.*,norm", "--data", data, "--max-tokens", "150", "-b", "2",
                "--attention", "layers.*", "--heads", "0,3", "--dtype", "fp32")  # fmt: skip
    acts = load_activations(out)
    assert acts.layers == ["layers.0", "layers.1", "layers.2", "norm"] and len(acts.tokens) == 150
    windows = [acts.tokens[i : i + SEQ] for i in range(0, 150, SEQ)]  # 4 full windows and one of 22
    assert [len(w) for w in windows] == [SEQ] * 4 + [22]
    hf = hf_model(root / "hf")
    # transformers' hidden_states end with the final norm's output in place of the last block's: that one is
    # read off the last decoder layer itself
    last_block = []
    hook = hf.model.layers[-1].register_forward_hook(
        lambda m, a, out: last_block.append(out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        hidden = [hf(torch.tensor(w, dtype=torch.long)[None], output_hidden_states=True).hidden_states for w in windows]
    hook.remove()
    assert len(hidden) == len(last_block) == 5 and all(len(h) == 3 + 1 for h in hidden)  # embeddings + 3 entries
    after_block = [torch.cat([h[n + 1][0] for h in hidden]) for n in range(2)]  # hidden_states[n + 1]: block n
    after_block.append(torch.cat([out[0] for out in last_block]))
    for n in range(3):
        ours = acts[f"layers.{n}"].numpy()
        assert ours.shape == (150, 64) and after_block[n].shape == (150, 64)
        bound = model_bound(cfg(), after_block[n].abs().max().item())
        parity.close(torch.from_numpy(ours), after_block[n], atol=bound, what=f"layers.{n}")
    theirs = torch.cat([h[-1][0] for h in hidden])
    bound = model_bound(cfg(), theirs.abs().max().item())
    parity.close(torch.from_numpy(acts["norm"].numpy()), theirs, atol=bound, what="norm")

    # attention: weights × V is the output of SDPA (the model's own path) for the chosen heads
    model = random_model(cfg()).eval()
    seen = {}
    model.layers["1"].attention.core.register_forward_hook(lambda m, a, o: seen.update(v=a[2], out=o))
    weights = acts["layers.1.attention.weights"]
    assert weights.shape == (5, 2, SEQ, SEQ)
    for w, window in enumerate(windows):
        with torch.no_grad():
            model(torch.tensor(window, dtype=torch.long)[None])
        length = len(window)
        stored = torch.from_numpy(np.asarray(weights[w]))[:, :length, :length]
        v = seen["v"][0, [0 // 2, 3 // 2]]  # grouped-query: heads 0 and 3 read kv heads 0 and 1
        out = seen["out"][0, [0, 3]]
        parity.close(stored @ v, out, atol=fp32_bound(v.abs().max().item(), SEQ, 2), what="weights × V")
        parity.close(stored.sum(-1), torch.ones(2, length), atol=fp32_bound(1.0, SEQ, 2), what="weights' sums")
        assert torch.all(torch.triu(stored, diagonal=1) == 0)  # causal
        assert np.all(np.asarray(weights[w])[:, length:] == 0)  # past the end of a short window
    assert len(acts.document_ends) == int((acts.tokens == acts.manifest["eos_id"]).sum()) > 0


def test_forward_stops_after_the_deepest_requested_module(setup, tmp_path):
    _, run, data = setup
    ran = []
    job = Extraction(run, tmp_path / "x", ExtractRequest(layers=("layers.0.attention",), data=str(data), max_tokens=40))
    for name, module in job.model.named_modules():
        module.register_forward_pre_hook(lambda m, a, name=name: ran.append(name))
    rows = job.forward([0])
    assert rows["layers.0.attention"].shape == (SEQ, 64)
    assert "layers.0.attention.wo" in ran and not {"layers.0.ffn_norm", "layers.1", "norm", "output"} & set(ran)
    ran.clear()
    job = Extraction(run, tmp_path / "y", ExtractRequest(layers=("norm",), data=str(data), max_tokens=40))
    for name, module in job.model.named_modules():
        module.register_forward_pre_hook(lambda m, a, name=name: ran.append(name))
    job.forward([0])
    assert "layers.2" in ran and "output" not in ran  # no logits unless the head is asked for
    assert not (tmp_path / "x").exists()


def test_bf16_is_exact_and_npz_equals_shards(setup, tmp_path):
    _, run, data = setup
    common = ("--layers", "tok_embeddings,layers.1.feed_forward,layers.2", "--data", data, "--max-tokens", "100")
    extract_cli(run, tmp_path / "fp32", *common)
    extract_cli(run, tmp_path / "bf16", *common, "--dtype", "bf16", "--shard-mb", "0.01")
    extract_cli(run, tmp_path / "npz", *common, "--dtype", "bf16", "--format", "npz")
    fp32, bf16, npz = (load_activations(tmp_path / n) for n in ("fp32", "bf16", "npz"))
    assert fp32.layers == bf16.layers == npz.layers == ["tok_embeddings", "layers.1.feed_forward", "layers.2"]
    assert len(bf16.manifest["shards"]) > 1 and sorted(os.listdir(tmp_path / "npz")) == [
        "activations.npz", "manifest.json", "request.json", "tokens.npy"]  # fmt: skip
    for name in fp32.layers:
        assert bf16[name].dtype == torch.bfloat16 and npz[name].dtype == torch.bfloat16
        expected = torch.from_numpy(fp32[name].numpy()).to(torch.bfloat16)
        assert torch.equal(bf16[name].torch().view(torch.int16), expected.view(torch.int16))
        assert torch.equal(npz[name].torch().view(torch.int16), expected.view(torch.int16))
        assert torch.equal(bf16[name][17:63].view(torch.int16), expected[17:63].view(torch.int16))
    assert np.array_equal(npz.tokens, fp32.tokens)
    with np.load(tmp_path / "npz" / "activations.npz") as raw:
        assert sorted(raw.files) == sorted(fp32.layers)


def test_killed_at_random_moments_resumes_byte_identical(setup, tmp_path):
    _, run, data = setup
    args = ["--layers", "layers.*", "--data", str(data), "--max-tokens", "380", "--shard-mb", "0.002", "-b", "1"]
    args += ["--positions", "all"]
    extract_cli(run, tmp_path / "reference", *args)
    reference = read_dir(tmp_path / "reference")
    assert sum(name.startswith("shard-") for name in reference) == 12  # one window per shard
    interrupted = 0
    for seed in range(3):
        out = tmp_path / f"killed{seed}"
        command = [sys.executable, "-m", "forgecli.app", "extract", str(run), "--out", str(out), *args]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        chance = random.Random(seed)
        done_before_kill = chance.randint(0, 8)  # shards on disk when the kill lands (of 12)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            if (out / "tokens.npy").exists() and len(list(out.glob("shard-*.safetensors"))) >= done_before_kill:
                break
            time.sleep(0.002)
        time.sleep(chance.uniform(0, 0.01))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        interrupted += not (out / "manifest.json").exists()
        extract_cli(run, out, *args)
        assert read_dir(out) == reference
    assert interrupted >= 2  # the kills really landed mid-extraction

    result = forge("extract", run, "--out", tmp_path / "reference", *args[:-1], "last")
    assert result.exit_code == 2 and "other arguments" in result.said
    assert read_dir(tmp_path / "reference") == reference


def other_tokenizer_shards(folder: Path, data: Path) -> Path:
    tokenize_files([data], folder, tokenizer=tokenizer_file(folder.parent / "other", vocab_size=300))
    return folder


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--layers", "layers.9", "--text", "hi"], ["layers.9", "matches no module", "layers.0"]),
        (["--layers", "layers", "--text", "hi"], ["cannot be extracted", "container"]),
        (["--layers", "layers.0.attention.core", "--text", "hi"], ["not laid out"]),
        (["--layers", "norm", "--data", "EMPTY"], ["no documents"]),
        (["--layers", "norm", "--data", "OTHER"], ["another tokenizer"]),
        (["--layers", "norm", "--data", "embedded:test"], ["no split 'test'", "embedded:val"]),
        (["--layers", "norm", "--text", "hi", "--step", "9"], ["--step 9", "step_5"]),
        (["--layers", "norm", "--text", "hi", "--attention", "layers.7"], ["--attention", "matches no block"]),
        (["--layers", "norm", "--text", "hi", "--seq-len", "999"], ["--seq-len", "32"]),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(setup, tmp_path, args, needles):
    _, run, data = setup
    (tmp_path / "empty.jsonl").write_text("")
    replaced = {"EMPTY": tmp_path / "empty.jsonl", "OTHER": "OTHER"}
    if "OTHER" in args:
        replaced["OTHER"] = other_tokenizer_shards(tmp_path / "shards", data)
    args = [str(replaced.get(a, a)) for a in args]
    result = forge("extract", run, "--out", tmp_path / "out", *args)
    assert result.exit_code == 2, result.output
    for needle in needles:
        assert needle in result.said, result.said
    assert not (tmp_path / "out").exists()


def test_another_tokenizers_corpus_is_refused_with_a_fix_that_writes_no_folder_forge_manages(setup, tmp_path):
    """`--data embedded:val` for a model of another tokenizer: the fix says to tokenize into a new folder,
    never over the embedded corpus's cache, which every run on it reads."""
    _, run, _ = setup
    result = forge("extract", run, "--layers", "norm", "--data", "embedded:val", "--out", tmp_path / "out")
    assert result.exit_code == 2 and "--data embedded:val" in result.said and "another tokenizer" in result.said
    fix = result.said.split("fix:", 1)[1]
    assert "--out NEW_DIR" in fix and str(embedded_corpus().val) not in fix, fix
    assert not (tmp_path / "out").exists()


def test_missing_checkpoint_and_foreign_output_folder(setup, tmp_path):
    _, run, _ = setup
    result = forge("extract", tmp_path / "nope", "--layers", "norm", "--text", "hi", "--out", tmp_path / "out")
    assert result.exit_code == 2 and "does not exist" in result.said and not (tmp_path / "out").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    result = forge("extract", run, "--layers", "norm", "--text", "hi", "--out", tmp_path / "mine")
    assert result.exit_code == 2 and "not a forge extract output" in result.said
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]


def test_list_layers_and_compare(setup, tmp_path, parity):
    _, run, data = setup
    result = forge("extract", run, "--list-layers", "--json")
    listed = json.loads(result.output)
    assert listed["layers.2"]["shape"] == [64] and listed["output"]["shape"] == [400]
    assert listed["layers.0.attention.wk"]["shape"] == [32] and listed["layers"]["shape"] is None
    extract_cli(run, tmp_path / "a", "--layers", "layers.*", "--data", data, "--max-tokens", "120")
    extract_cli(
        run, tmp_path / "last", "--layers", "layers.2", "--data", data, "--max-tokens", "120", "--positions", "last"
    )
    every, last = load_activations(tmp_path / "a"), load_activations(tmp_path / "last")
    ends = [31, 63, 95, 119]  # the last position of each window (the fourth one is short)
    assert np.array_equal(last.tokens, every.tokens[ends])
    # the same forward, once keeping every position and once the last: bit for bit
    parity.close(
        torch.from_numpy(last["layers.2"].numpy()),
        torch.from_numpy(every["layers.2"][ends]),
        atol=0,
        what="last positions",
    )
    result = forge("extract", "compare", tmp_path / "a", "--metric", "cka", "--json")
    matrix = np.array(json.loads(result.output)["values"])
    assert matrix.shape == (3, 3) and np.allclose(np.diag(matrix), 1) and np.allclose(matrix, matrix.T)
    plot = tmp_path / "cka.png"
    result = forge("extract", "compare", tmp_path / "a", tmp_path / "a", "--metric", "svcca", "--plot", plot)
    assert result.exit_code == 0 and plot.stat().st_size > 1000 and "svcca" in result.output


TWO_PROCESS_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from engine.config.model import ModelConfig
    from engine.model.transformer import Transformer
    from forgecli.app import app
    from tests.helpers.torchrun import save_sharded_checkpoint

    run, shape, data = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    torch.manual_seed(7)
    model = Transformer(ModelConfig(vocab_size=400, max_seq_len=32, **shape))
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    save_sharded_checkpoint(model, run / "checkpoints" / "step_3", 3)
    # the command as a worker of `forge extract --nproc-per-node 2` runs it (the group is joined already)
    try:
        app(["extract", str(run), "--out", str(run.parent / "two"), "--layers", "layers.*,output", "--data", data,
             "--max-tokens", "300", "-b", "2", "--shard-mb", "0.02", "--attention", "layers.0", "--step", "3"])
    except SystemExit as ended:
        assert not ended.code, ended.code
    dist.destroy_process_group()
    from engine.parallel.launch import end_process
    end_process(0)
""")


def test_two_processes_write_what_one_writes_from_an_fsdp_checkpoint(setup, tmp_path, parity):
    _, _, data = setup
    run = tmp_path / "fsdp"
    run.mkdir()
    (run / "config.toml").write_text(dump_toml(JobConfig(model=cfg())))
    tokenizer_file(run)
    script = tmp_path / "two.py"
    script.write_text(TWO_PROCESS_SCRIPT)
    result = torchrun(script, 2, str(run), json.dumps(SHAPE), str(data), timeout=180)
    assert result.returncode == 0, result.stdout[-4000:]
    assert len(list((run / "checkpoints" / "step_3").glob("*.distcp"))) == 2  # really sharded
    extract_cli(run, tmp_path / "one", "--layers", "layers.*,output", "--data", data, "--max-tokens", "300",
                "-b", "2", "--shard-mb", "0.02", "--attention", "layers.0", "--step", "3")  # fmt: skip
    one, two = read_dir(tmp_path / "one"), read_dir(tmp_path / "two")
    assert sum(name.startswith("shard-") for name in one) >= 3 and one == two
    acts = load_activations(tmp_path / "one")
    torch.manual_seed(7)
    from engine.model.transformer import Transformer

    reference = Transformer(cfg()).eval()
    with torch.no_grad():
        logits = reference(torch.from_numpy(acts.tokens[:SEQ].astype(np.int64))[None])[0]
    theirs = logits.numpy()  # fp32, our model: the same kernels, but another batch split
    bound = model_bound(cfg(), np.abs(theirs).max())
    parity.close(
        torch.from_numpy(np.asarray(acts["output"][:SEQ])), torch.from_numpy(theirs), atol=bound, what="logits"
    )
    assert acts.manifest["step"] == 3


def test_moe_routing_and_token_shards(setup, tmp_path, parity):
    """Routing of a MoE block as the router computed it, over a `forge tokenize` folder of the same text."""
    _, _, data = setup
    moe = ModelConfig(vocab_size=400, max_seq_len=SEQ, dim=32, n_layers=2, n_heads=2, num_experts=4, moe_top_k=2)
    run = make_run(tmp_path / "moe", random_model(moe).eval(), with_tokenizer=True)
    shards = tmp_path / "shards"
    tokenize_files([data], shards, tokenizer=run / "tokenizer.json")
    extract_cli(run, tmp_path / "acts", "--routing", "layers.*", "--layers", "layers.0", "--data", shards,
                "--max-tokens", "70")  # fmt: skip
    acts = load_activations(tmp_path / "acts")
    experts, weights = acts["layers.1.routing.experts"], acts["layers.1.routing.weights"]
    assert experts.shape == (70, 2) and experts.dtype == torch.int32 and weights.shape == (70, 2)
    model = random_model(moe).eval()
    seen = []
    model.layers["1"].feed_forward.router.register_forward_hook(lambda m, a, out: seen.append(out))
    for start in (0, SEQ, 2 * SEQ):
        with torch.no_grad():
            model(torch.from_numpy(acts.tokens[start : start + SEQ].astype(np.int64))[None])
    assert np.array_equal(experts.numpy(), torch.cat([r.experts for r in seen]).numpy())
    # routing weights ≤ 1: a dot product over dim and a softmax (fp32_bound of depth 2)
    expected = torch.cat([r.weights for r in seen])
    parity.close(torch.from_numpy(weights.numpy()), expected, atol=fp32_bound(1.0, moe.dim, 2), what="routing weights")
    direct = Extraction(run, tmp_path / "unused", ExtractRequest(layers=("norm",), data=str(data), max_tokens=70))
    assert np.array_equal(acts.tokens, direct.tokens.read(0, 70))  # shards hold what the files tokenize to
    result = forge("extract", setup[1], "--routing", "layers.*", "--text", "hi", "--out", tmp_path / "dense")
    assert result.exit_code == 2 and "the model is dense" in result.said and not (tmp_path / "dense").exists()


def test_data_embedded_val_is_the_cached_held_out_split(tmp_path):
    """`--data embedded:val` reads the held-out split of the embedded corpus wherever FORGE_CACHE_DIR keeps it."""
    val = embedded_corpus().val
    run = make_run(tmp_path / "run", random_model(ModelConfig(vocab_size=4096, max_seq_len=SEQ, dim=32, n_layers=1,
                                                              n_heads=2)).eval())  # fmt: skip
    shutil.copy(val / "tokenizer.json", run / "tokenizer.json")  # a run trained on the embedded corpus
    extract_cli(run, tmp_path / "acts", "--layers", "norm", "--data", "embedded:val", "--max-tokens", "40")
    manifest = read_manifest(val)
    held_out = np.concatenate([open_shard(val, info, manifest.dtype) for info in manifest.shards])
    assert np.array_equal(load_activations(tmp_path / "acts").tokens, held_out[:40])


def test_indexing_a_layer_across_shards_is_numpy_indexing():
    from engine.interp.store import LayerArray

    whole = np.arange(40, dtype=np.float32).reshape(20, 2)
    layer = LayerArray([whole[:7], whole[7:12], whole[12:]], "F32")
    picks = [slice(3, 15), slice(None, None, 3), slice(-5, None), slice(15, 3, -2), slice(5, 5), 4, -1, [19, 2, 8]]
    picks += [np.arange(20) % 3 == 0, (slice(2, 9), 1), (5, 0)]
    assert len(picks) == 11
    for pick in picks:
        assert np.array_equal(layer[pick], whole[pick]), pick
    assert layer.shape == (20, 2) and np.array_equal(layer.numpy(), whole)
