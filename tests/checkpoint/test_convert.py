"""`forge convert` against a reference nobody here wrote: Hugging Face `transformers` must compute the same
logits and greedy tokens from an export; the round trip is bitwise; a checkpoint saved under FSDP exports
like the single-process model; bad input exits 2 and leaves nothing behind."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import AddedToken, processors

from engine.checkpoint.dcp import load_checkpoint, save_checkpoint
from engine.checkpoint.hf import export_to_hf, import_from_hf, is_hf_folder, load_hf_weights
from engine.config import JobConfig, dump_toml
from engine.config.changes import resume_issues
from engine.config.model import ModelConfig
from engine.errors import UserError
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
from tests.helpers.data_fixtures import tokenizer_file
from tests.helpers.parity import U32, model_bound
from tests.helpers.torchrun import torchrun

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "mha": dict(dim=64, n_layers=2, n_heads=4),
    "gqa-tied": dict(
        dim=64, n_layers=2, n_heads=8, n_kv_heads=2, tie_embeddings=True, norm_eps=1e-6, rope_theta=500000.0
    ),
    "mqa-ffn": dict(dim=48, n_layers=2, n_heads=4, n_kv_heads=1, ffn_hidden_dim=100, norm_eps=1e-5, rope_theta=50000.0),
    "qk_norm": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, qk_norm=True, norm_eps=1e-6),
    "qk_norm-tied": dict(dim=32, n_layers=1, n_heads=2, qk_norm=True, tie_embeddings=True, rope_theta=1e6),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_transformers_computes_the_same_logits_and_greedy_tokens(tmp_path, name, parity):
    model = random_model(model_config(**CONFIGS[name])).eval()
    export_to_hf(make_run(tmp_path / "run", model), tmp_path / "hf")
    hf = hf_model(tmp_path / "hf")
    assert type(hf).__name__ == ("Qwen3ForCausalLM" if model.cfg.qk_norm else "LlamaForCausalLM")
    assert_same_as_transformers(parity, hf, model, seq=40, prompt=8, new_tokens=24)


@pytest.mark.parametrize("name", ["mha", "qk_norm-tied"])
def test_round_trip_is_bitwise_and_trains_identically(tmp_path, name):
    cfg = model_config(**CONFIGS[name])
    model = random_model(cfg)
    export_to_hf(make_run(tmp_path / "run", model), tmp_path / "hf", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # the small threshold split the weights into files
    import_from_hf(tmp_path / "hf", tmp_path / "back")

    back = Transformer(cfg)
    load_checkpoint(tmp_path / "back" / "step_0", back)
    for (key, a), b in zip(model.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), key
    assert (back.output.weight is back.tok_embeddings.weight) == cfg.tie_embeddings
    tokens = torch.randint(0, VOCAB, (4, 33))
    assert one_step_then_loss(model, tokens) == one_step_then_loss(back, tokens)


def one_step_then_loss(model: Transformer, tokens: torch.Tensor) -> float:
    def loss() -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss().backward()
    optimizer.step()
    with torch.no_grad():
        return loss().item()


def test_from_hf_writes_a_checkpoint_folder_and_its_model_section(tmp_path):
    cfg = model_config(**CONFIGS["gqa-tied"])
    export_to_hf(make_run(tmp_path / "run", random_model(cfg), with_tokenizer=True), tmp_path / "hf")
    result = forge("convert", "from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"))
    assert result.exit_code == 0, result.output
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == "step_0" and (ckpt / "step_0" / "COMPLETE").is_file()
    assert (ckpt / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()
    assert "[model]" in result.stdout and "n_kv_heads = 2" in result.stdout
    from engine.config import load_job_config

    imported = load_job_config(ckpt / "model.toml").model
    for field in (
        "dim",
        "n_layers",
        "n_heads",
        "kv_heads",
        "vocab_size",
        "ffn_dim",
        "norm_eps",
        "rope_theta",
        "tie_embeddings",
        "qk_norm",
        "max_seq_len",
    ):
        assert getattr(imported, field) == getattr(cfg, field), field
    # ... and it is a checkpoint like any other: it exports again, identically.
    export_to_hf(ckpt, tmp_path / "hf2")
    assert (tmp_path / "hf2" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()


def test_export_casts_to_the_requested_dtype_and_ships_the_tokenizer(tmp_path):
    model = random_model(model_config(**CONFIGS["mha"]))
    run = make_run(tmp_path / "run", model, with_tokenizer=True)
    result = forge("convert", "to-hf", str(run), "--out", str(tmp_path / "hf"), "--dtype", "bfloat16", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["architecture"] == "LlamaForCausalLM" and report["parameters"] == model.num_parameters()
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), model.tok_embeddings.weight.bfloat16())
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"

    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    from engine.data.tokenizer import Encoder

    ours = Encoder.from_file(run / "tokenizer.json")
    text = "To be, or not to be: that is the question."
    # A text starts after the end-of-text token, as every training document (and forge generate's prompt) does.
    assert tokenizer(text).input_ids == [ours.eos_id, *ours.tokenizer.encode(text, add_special_tokens=False).ids]
    assert tokenizer.eos_token == ours.eos_token and config["eos_token_id"] == ours.eos_id
    assert tokenizer.bos_token == ours.eos_token and config["bos_token_id"] == ours.eos_id
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == generation["bos_token_id"] == ours.eos_id
    assert (run / "tokenizer.json").read_bytes() == tokenizer_file(tmp_path / "fresh").read_bytes()  # run's: as trained


def _byte_level(tokenizer) -> None:
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)  # adds no tokens


def _llama_bos(tokenizer) -> None:
    tokenizer.add_special_tokens([AddedToken("<s>", special=True)])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 400)])


@pytest.mark.parametrize(
    ("edit", "bos"), [(None, "<|endoftext|>"), (_byte_level, "<|endoftext|>"), (_llama_bos, "<s>")]
)
def test_the_exported_tokenizer_encodes_raw_text_as_forge_generate_prompts_it(tmp_path, edit, bos):
    """transformers' `tok(text)` on the export gives `prompt_ids`: the end-of-text token first for a tokenizer
    that adds nothing (whatever post-processor it has), a tokenizer's own BOS kept as it is."""
    from tokenizers import Tokenizer

    from engine.checkpoint.hf import export_tokenizer
    from engine.data.tokenizer import Encoder
    from engine.generate import prompt_ids

    tokenizer = Tokenizer.from_file(str(tokenizer_file(tmp_path / "run")))
    if edit is not None:
        edit(tokenizer)
    tokenizer.save(str(tmp_path / "run" / "tokenizer.json"))
    encoder = Encoder.from_file(tmp_path / "run" / "tokenizer.json")
    exported = export_tokenizer(encoder, 64)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_bytes(exported.json_bytes)
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(exported.config))
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in ("ROMEO:", " two  spaces\nand a line", "To be, or not to be"):
        assert (
            tok(text)["input_ids"]
            == prompt_ids(encoder, text)
            == Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json")).encode(text).ids
        )
    assert tok.bos_token == bos and exported.bos_id == tok.bos_token_id == prompt_ids(encoder, "x")[0]


def test_load_hf_weights_fills_a_model_and_checks_its_architecture(tmp_path):
    cfg = model_config(**CONFIGS["qk_norm"])
    model = random_model(cfg)
    export_to_hf(make_run(tmp_path / "run", model), tmp_path / "hf", max_shard_bytes=40_000)
    assert is_hf_folder(tmp_path / "hf") and not is_hf_folder(tmp_path / "run")
    fresh = Transformer(cfg)
    load_hf_weights(fresh, tmp_path / "hf")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    with pytest.raises(UserError, match=r"model.rope_theta"):
        load_hf_weights(Transformer(cfg.model_copy(update={"rope_theta": 1234.0})), tmp_path / "hf")


@pytest.mark.parametrize("field, value", [("norm_type", "layernorm"), ("activation", "gelu")])
def test_models_transformers_cannot_express_are_refused(tmp_path, field, value):
    model = random_model(model_config(**CONFIGS["mha"], **{field: value}))
    result = forge("convert", "to-hf", str(make_run(tmp_path / "run", model)), "--out", str(tmp_path / "hf"))
    assert result.exit_code == 2 and f"model.{field}" in said(result)
    assert no_leftovers(tmp_path / "hf")


def test_a_checkpoint_saved_under_fsdp_exports_like_the_single_process_model(tmp_path, parity):
    """2 gloo ranks: load HF weights into an FSDP2 model (each rank keeps its shard), check its logits,
    save a sharded DCP checkpoint; that checkpoint then exports to the same model as the unsharded one."""
    cfg = model_config(**CONFIGS["gqa-tied"])
    reference = random_model(cfg).eval()
    export_to_hf(make_run(tmp_path / "single", reference), tmp_path / "hf-single")
    tokens = torch.randint(0, VOCAB, (2, 24))
    torch.save(tokens, tmp_path / "tokens.pt")
    run = tmp_path / "fsdp"
    run.mkdir()
    (run / "config.toml").write_text(dump_toml(JobConfig(model=cfg)))
    script = tmp_path / "fsdp_save.py"
    script.write_text(FSDP_SCRIPT)
    result = torchrun(script, 2, str(tmp_path), json.dumps(CONFIGS["gqa-tied"]), str(VOCAB), timeout=120)
    assert result.returncode == 0, result.stdout[-4000:]

    with torch.no_grad():
        expected = reference(tokens)
        bound = model_bound(cfg, expected.abs().max().item())  # fp32: HF weights are loaded as exported
        parity.close(torch.load(tmp_path / "fsdp_logits.pt"), expected, atol=bound, what="FSDP logits")
        assert len(list((run / "checkpoints" / "step_1").glob("*.distcp"))) == 2  # really sharded
        export_to_hf(run, tmp_path / "hf-fsdp")
    assert_same_logits(parity, hf_model(tmp_path / "hf-fsdp"), reference, tokens)  # the export's


FSDP_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from engine.checkpoint.hf import load_hf_weights
    from engine.config.model import ModelConfig
    from engine.model.transformer import Transformer
    from tests.helpers.torchrun import save_sharded_checkpoint

    tmp, shape, vocab = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    torch.manual_seed(123)  # other weights than the reference: every value must come from the HF folder
    model = Transformer(ModelConfig(vocab_size=vocab, max_seq_len=64, **shape))
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    load_hf_weights(model, tmp / "hf-single")
    assert model.tok_embeddings.weight.to_local().shape[0] < vocab  # each rank holds a shard
    with torch.no_grad():
        logits = model(torch.load(tmp / "tokens.pt"))
    model.reshard()  # the root keeps its parameters gathered after forward (for backward); shard them again
    if dist.get_rank() == 0:
        torch.save(logits, tmp / "fsdp_logits.pt")
    save_sharded_checkpoint(model, tmp / "fsdp" / "checkpoints" / "step_1", 1)
    dist.destroy_process_group()
    from engine.parallel.launch import end_process
    end_process(0)  # leave without interpreter teardown while gloo's threads live (see end_process)
""")


# ------------------------------------------------------------------ bad input through the CLI


def llama_config(**changes) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "vocab_size": 50,
    }
    return {**config, **changes}


def hf_folder(path: Path, config: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_to_hf_bad_input_exits_2_and_writes_nothing(tmp_path):
    model = random_model(model_config(**CONFIGS["mha"]))
    run = make_run(tmp_path / "run", model)
    (tmp_path / "empty").mkdir()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    incomplete = run / "checkpoints" / "step_9"
    incomplete.mkdir()
    corrupt = tmp_path / "corrupt" / "step_1"
    corrupt.mkdir(parents=True)
    (corrupt.parent / "model.toml").write_text((run / "config.toml").read_text())
    (corrupt / "COMPLETE").write_text("")
    (corrupt / ".metadata").write_bytes(b"garbage")
    damaged = tmp_path / "damaged"
    shutil.copytree(run, damaged)
    next((damaged / "checkpoints" / "step_5").glob("*.distcp")).write_bytes(b"cut short")
    cases = [
        ([str(tmp_path / "nowhere")], "does not exist"),
        ([str(tmp_path / "empty")], "not a Forge run directory"),
        ([str(hf_folder(tmp_path / "llama", llama_config()))], "forge convert from-hf"),
        ([str(incomplete)], "incomplete"),
        ([str(corrupt)], "cannot read checkpoint"),
        ([str(damaged)], "its files are damaged or incomplete"),
        ([str(damaged)], "EOFError"),  # the cause itself, not DCP's wrapper
        ([str(run), "--dtype", "float8"], "--dtype 'float8'"),
        ([str(run), "--dtype", "bf16"], "float32, bfloat16, float16"),
    ]
    for args, needle in cases:
        out = tmp_path / "out"
        result = forge("convert", "to-hf", *args, "--out", str(out))
        assert result.exit_code == 2, (args, result.output)
        assert needle in said(result) and "Traceback" not in result.output, (args, result.stderr)
        assert no_leftovers(out), args
    result = forge("convert", "to-hf", str(run), "--out", str(tmp_path / "taken"))
    assert result.exit_code == 2 and "already exists" in said(result)
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["file"]
    result = forge("convert", "to-hf", str(run), "--out", str(tmp_path / "taken" / "file" / "out"))
    assert result.exit_code == 2 and "cannot write into" in said(result)
    with open(next((tmp_path / "run" / "checkpoints" / "step_5").glob("*.distcp")), "rb") as f:
        assert f.read(1)  # the good run is untouched


def test_from_hf_bad_input_exits_2_and_writes_nothing(tmp_path):
    neox = hf_folder(tmp_path / "neox", {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"})
    (neox / "model.safetensors").write_bytes(b"")
    gpt2 = hf_folder(tmp_path / "gpt2", {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 32})
    no_weights = hf_folder(tmp_path / "no-weights", llama_config())
    pickled = hf_folder(tmp_path / "pickled", llama_config())
    (pickled / "pytorch_model.bin").write_bytes(b"\x80")
    scaled = hf_folder(tmp_path / "scaled", llama_config(rope_scaling={"rope_type": "yarn", "factor": 8.0}))
    biased = hf_folder(tmp_path / "biased", llama_config(attention_bias=True))
    sharded = hf_folder(tmp_path / "sharded", llama_config())
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}})
    )
    corrupt = hf_folder(tmp_path / "corrupt", llama_config())
    (corrupt / "model.safetensors").write_bytes(b"not safetensors")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    cases = [
        (tmp_path / "nowhere", "nowhere does not exist"),
        (broken / "config.json", "config.json is not a folder"),
        (tmp_path, "no config.json"),
        (neox, "'gpt_neox' (GPTNeoXForCausalLM)"),
        (gpt2, "config.json has no 'n_layer'"),
        (no_weights, "no model.safetensors"),
        (pickled, "pickled"),
        (scaled, "RoPE scaling 'yarn'"),
        (biased, "attention_bias"),
        (sharded, "model-00001-of-00002.safetensors"),
        (corrupt, "not a readable safetensors file"),
        (broken, "not valid JSON"),
    ]
    for folder, needle in cases:
        out = tmp_path / "out"
        result = forge("convert", "from-hf", str(folder), "--out", str(out))
        assert result.exit_code == 2, (folder, result.output)
        assert needle in said(result) and "Traceback" not in result.output, (folder, result.stderr)
        assert no_leftovers(out), folder


def test_from_hf_refuses_weights_that_do_not_match_the_config(tmp_path):
    model = random_model(model_config(**CONFIGS["mha"]))
    export_to_hf(make_run(tmp_path / "run", model), tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    result = forge("convert", "from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "out"))
    assert result.exit_code == 2 and "mlp.down_proj.weight has shape [64, 256], config.json implies [64, 128]" in said(
        result
    )
    assert no_leftovers(tmp_path / "out")


def test_a_failure_while_writing_leaves_no_partial_output(tmp_path, monkeypatch):
    import engine.checkpoint.hf as hf

    model = random_model(model_config(**CONFIGS["mha"]))
    run = make_run(tmp_path / "run", model)
    written = []

    def failing_save(tensors, path, metadata=None):
        written.append(path)
        if len(written) == 3:
            raise OSError("disk full")
        return save(tensors, path, metadata=metadata)

    save = hf.save_file
    monkeypatch.setattr(hf, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        export_to_hf(run, tmp_path / "hf", max_shard_bytes=40_000)
    assert no_leftovers(tmp_path / "hf") and len(written) == 3


def test_checkpoint_load_path_may_name_a_hugging_face_folder(tmp_path):
    from engine.checkpoint.manager import initialize_from

    cfg = model_config(**CONFIGS["qk_norm"])
    model = random_model(cfg)
    export_to_hf(make_run(tmp_path / "run", model), tmp_path / "hf")
    torch.manual_seed(3)
    fresh = Transformer(cfg)
    kept = fresh.output.weight.detach().clone()
    loaded = initialize_from(tmp_path / "hf", fresh, ["output."])
    assert "output.weight" not in loaded and torch.equal(fresh.output.weight, kept)
    for name, value in model.state_dict().items():
        if not name.startswith("output."):
            assert torch.equal(fresh.state_dict()[name], value), name


def test_schedule_free_runs_export_and_sample_their_averaged_weights(tmp_path, parity):
    """Schedule-free AdamW checkpoints hold y (for exact resume); export and generate use x, the average.
    x is computed from y and z in fp32 by two routes (eval_mode here, the loader there): x = (y − (1 − β1)·z)/β1
    rounds ≤ 4 times, each by U32 of operands up to 1/(1 − β1) = 10 times max|x, y|."""
    from engine.config.optimizer import OptimizerConfig
    from engine.generate import load_model
    from engine.train.optim import build_optimizer, eval_mode

    cfg = model_config(**CONFIGS["gqa-tied"])
    model = random_model(cfg)
    opt_cfg = OptimizerConfig(name="schedule_free_adamw", lr=1e-2, betas=(0.9, 0.999))
    optimizer = build_optimizer(model, opt_cfg)
    for seed in range(3):
        tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))
        torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    with eval_mode(optimizer):
        x = {name: p.detach().clone() for name, p in model.named_parameters()}
    y = {name: p.detach().clone() for name, p in model.named_parameters()}
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(dump_toml(JobConfig(model=cfg, optimizer=opt_cfg)))
    tokenizer_file(run)
    save_checkpoint(run / "checkpoints", 3, model, optimizer, {"step": 3})

    largest = max(t.abs().max().item() for t in [*x.values(), *y.values()])
    bound = 4 * U32 * 10 * largest
    loaded, _ = load_model(run, torch.device("cpu"))
    sampled = {name: param.detach() for name, param in loaded.named_parameters()}
    assert sorted(sampled) == sorted(x)
    parity.close(sampled, x, atol=bound, what="the sampled model's weights")
    assert not any(torch.equal(param, y[name]) for name, param in sampled.items())
    export_to_hf(run, tmp_path / "hf")
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        exported = f.get_tensor("model.embed_tokens.weight")
        parity.close(exported, x["tok_embeddings.weight"], atol=bound, what="the export's embedding")


# ------------------------------------------------------------------ mixture of experts

MOE = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, num_experts=4, moe_top_k=2)
# name → (the [model] fields, the transformers class that must compute the same logits)
MOE_CONFIGS = {
    "softmax": (dict(MOE), "Qwen2MoeForCausalLM"),
    "softmax-every2nd-unpacked": (
        dict(MOE, moe_frequency=2, moe_packed_experts=False, moe_expert_ffn_multiplier=0.25),
        "Qwen2MoeForCausalLM",
    ),
    "softmax-qk_norm-tied": (dict(MOE, qk_norm=True, tie_embeddings=True, moe_top_k=1), "Qwen3MoeForCausalLM"),
    "softmax-qk_norm-every2nd-unpacked": (
        dict(MOE, qk_norm=True, moe_frequency=2, moe_packed_experts=False),
        "Qwen3MoeForCausalLM",
    ),
    "sigmoid-shared": (
        dict(MOE, moe_router="sigmoid_topk", moe_shared_experts=1, moe_expert_ffn_multiplier=0.5),
        "Glm4MoeForCausalLM",
    ),
    "sigmoid-2shared-qk_norm-unpacked": (
        dict(MOE, moe_router="sigmoid_topk", moe_shared_experts=2, qk_norm=True, moe_packed_experts=False, moe_top_k=3),
        "Glm4MoeForCausalLM",
    ),
    "sigmoid-last-block-only": (dict(MOE, moe_router="sigmoid_topk", moe_frequency=2), "Glm4MoeForCausalLM"),
    "sigmoid-dropless-capacity": (
        dict(MOE, moe_router="sigmoid_topk", moe_shared_experts=1, moe_capacity_factor=2.0),
        "Glm4MoeForCausalLM",
    ),
    "sigmoid-grouped": (
        dict(MOE, num_experts=8, moe_top_k=3, moe_router="sigmoid_topk", moe_n_group=4, moe_topk_group=2),
        "Glm4MoeForCausalLM",
    ),
    "mixtral": (dict(MOE, moe_router="softmax_topk_renorm"), "MixtralForCausalLM"),
    "renorm-qk_norm": (dict(MOE, moe_router="softmax_topk_renorm", qk_norm=True), "Qwen3MoeForCausalLM"),
    "renorm-every2nd-narrow": (
        dict(MOE, n_layers=3, moe_router="softmax_topk_renorm", moe_frequency=2, moe_expert_ffn_multiplier=0.5),
        "Qwen2MoeForCausalLM",
    ),
}


def random_moe_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """`random_model`, plus a balancing bias as training leaves it (it changes which experts are chosen)."""
    model = random_model(cfg, seed)
    with torch.no_grad():
        for router in model.moe_routers().values():
            if hasattr(router, "bias"):
                router.bias.copy_(torch.randn(router.bias.shape) * 0.3)
                router.updates.fill_(7)
    return model


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_transformers_computes_the_same_moe_logits_and_greedy_tokens(tmp_path, name, parity):
    fields, architecture = MOE_CONFIGS[name]
    model = random_moe_model(model_config(**fields)).eval()
    result = forge("convert", "to-hf", str(make_run(tmp_path / "run", model)), "--out", str(tmp_path / "hf"), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["architecture"] == architecture
    hf = hf_model(tmp_path / "hf")
    assert type(hf).__name__ == architecture
    # Nothing extra that computes (Qwen2-MoE's gate of the zero-width shared expert multiplies 0).
    assert sum(p.numel() for n, p in hf.named_parameters() if "shared_expert_gate" not in n) == model.num_parameters()
    assert_same_as_transformers(parity, hf, model, seq=24, prompt=6, new_tokens=16)


@pytest.mark.parametrize("name", ["softmax-qk_norm-every2nd-unpacked", "sigmoid-shared", "sigmoid-grouped", "mixtral"])
def test_moe_round_trip_through_hugging_face(tmp_path, name):
    """Forge → HF → Forge: the imported checkpoint has the same [model] routing and computes the same logits
    (bitwise: the same weights, stacked into packed experts); loading the HF folder into a model with
    either expert layout gives the same weights."""
    cfg = model_config(**MOE_CONFIGS[name][0])
    model = random_moe_model(cfg).eval()
    export_to_hf(make_run(tmp_path / "run", model), tmp_path / "hf", max_shard_bytes=20_000)
    result = forge("convert", "from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back"))
    assert result.exit_code == 0, result.output
    from engine.config import load_job_config

    imported = load_job_config(tmp_path / "back" / "model.toml").model
    for field in (
        "num_experts",
        "moe_top_k",
        "moe_frequency",
        "moe_router",
        "moe_n_group",
        "moe_topk_group",
        "moe_shared_experts",
        "expert_ffn_dim",
        "qk_norm",
        "dim",
        "ffn_dim",
    ):
        assert getattr(imported, field) == getattr(cfg, field), field
    assert imported.moe_packed_experts
    back = Transformer(imported).eval()
    load_checkpoint(tmp_path / "back" / "step_0", back)
    tokens = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        assert torch.equal(back(tokens), model(tokens))
    for packed in (True, False):
        fresh = Transformer(cfg.model_copy(update={"moe_packed_experts": packed})).eval()
        load_hf_weights(fresh, tmp_path / "hf")
        with torch.no_grad():
            assert torch.equal(fresh(tokens), model(tokens)), packed
    export_to_hf(tmp_path / "back", tmp_path / "hf2", max_shard_bytes=20_000)  # and it exports identically
    first, second = hf_state(tmp_path / "hf"), hf_state(tmp_path / "hf2")
    assert list(first) == list(second) and all(torch.equal(first[k], second[k]) for k in first)


HF_MADE = {
    "mixtral": (
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
        dict(moe_router="softmax_topk_renorm", num_experts=4, moe_top_k=2, ffn_dim=48),
    ),
    "glm4_moe-grouped": (
        "Glm4MoeConfig",
        dict(
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            intermediate_size=64,
            moe_intermediate_size=32,
            first_k_dense_replace=0,
            partial_rotary_factor=1.0,
            routed_scaling_factor=1.0,
            norm_topk_prob=True,
            num_nextn_predict_layers=0,
        ),
        dict(moe_router="sigmoid_topk", num_experts=8, moe_n_group=4, moe_topk_group=2, expert_ffn_dim=32),
    ),
    "qwen3_moe-renorm": (
        "Qwen3MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, intermediate_size=64, moe_intermediate_size=32),
        dict(moe_router="softmax_topk_renorm", qk_norm=True, expert_ffn_dim=32),
    ),
}
"""name → (transformers config class, its routing fields, what the imported [model] section must say)."""


@pytest.mark.parametrize("name", list(HF_MADE))
def test_a_model_transformers_made_imports_with_the_same_logits(tmp_path, name, parity):
    """The other direction: random weights initialised by transformers (norms and the balancing bias moved off
    their defaults), saved by save_pretrained, imported by `forge convert from-hf`: the same logits."""
    config_class, routing, expected = HF_MADE[name]
    torch.manual_seed(1)
    hf_cfg = getattr(transformers, config_class)(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        initializer_range=0.3,
        **routing,
    )
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
        for module in hf.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.copy_(torch.randn_like(module.e_score_correction_bias) * 0.3)
    hf.save_pretrained(tmp_path / "hf")
    result = forge("convert", "from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"))
    assert result.exit_code == 0, result.output
    from engine.config import load_job_config

    imported = load_job_config(tmp_path / "ckpt" / "model.toml").model
    assert {field: getattr(imported, field) for field in expected} == expected
    model = Transformer(imported).eval()
    load_checkpoint(tmp_path / "ckpt" / "step_0", model)
    tokens = torch.randint(0, VOCAB, (2, 24))
    assert_same_logits(parity, hf, model, tokens)
    with torch.no_grad():
        ours = model(tokens)
        if imported.moe_n_group > 1:  # the groups decided some choices: routing without them differs
            ungrouped = Transformer(imported.model_copy(update={"moe_n_group": 1, "moe_topk_group": 1})).eval()
            ungrouped.load_state_dict(model.state_dict())
            assert (ungrouped(tokens) - ours).abs().max() > 1e-2


def hf_state(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder, whichever file holds it."""
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            state.update({name: f.get_tensor(name) for name in f.keys()})
    return dict(sorted(state.items()))


@pytest.mark.parametrize(
    "fields, needle",
    [
        (dict(MOE, moe_shared_experts=1), "model.moe_shared_experts = 1 with moe_router = 'softmax_topk'"),
        (
            dict(MOE, moe_shared_experts=1, moe_router="softmax_topk_renorm"),
            "model.moe_shared_experts = 1 with moe_router = 'softmax_topk_renorm'",
        ),
        (dict(MOE, moe_capacity_factor=1.25), "model.moe_capacity_factor = 1.25"),
        (dict(MOE, n_layers=4, moe_router="sigmoid_topk", moe_frequency=2), "model.moe_frequency = 2"),
        (dict(MOE, moe_router="sigmoid_topk", num_experts=1, moe_top_k=1), "model.num_experts = 1"),
    ],
)
def test_moe_models_transformers_cannot_express_are_refused(tmp_path, fields, needle):
    model = random_model(model_config(**fields))
    result = forge("convert", "to-hf", str(make_run(tmp_path / "run", model)), "--out", str(tmp_path / "hf"))
    assert result.exit_code == 2 and needle in said(result), said(result)
    assert no_leftovers(tmp_path / "hf")


def moe_config(model_type: str, **changes) -> dict:
    config = llama_config(model_type=model_type, architectures=[], num_experts_per_tok=2, moe_intermediate_size=32)
    if model_type == "glm4_moe":
        config.update(
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=0,
            partial_rotary_factor=1.0,
            num_nextn_predict_layers=0,
        )
    else:
        config.update(num_experts=4, qkv_bias=False, shared_expert_intermediate_size=0)
    return {**config, **changes}


def test_from_hf_refuses_moe_routing_forge_does_not_compute(tmp_path):
    cases = [
        (moe_config("qwen2_moe", shared_expert_intermediate_size=64), "shared_expert_intermediate_size = 64"),
        (moe_config("qwen2_moe", use_sliding_window=True), "use_sliding_window = true in an MoE model"),
        (moe_config("qwen3_moe", mlp_only_layers=[0]), "mlp_only_layers = [0]"),
        (moe_config("glm4_moe", n_group=4, topk_group=2), "model.moe_n_group = 4 does not split"),
        (moe_config("glm4_moe", n_group=2, topk_group=3), "model.moe_topk_group = 3 exceeds"),
        (moe_config("glm4_moe", routed_scaling_factor=2.5), "routed_scaling_factor = 2.5"),
        (moe_config("glm4_moe", partial_rotary_factor=0.5), "partial_rotary_factor = 0.5"),
        (moe_config("glm4_moe", num_hidden_layers=4, first_k_dense_replace=1), "first_k_dense_replace = 1"),
        (moe_config("mixtral", num_local_experts=4, router_jitter_noise=0.1), "router_jitter_noise = 0.1"),
        (moe_config("mixtral", num_local_experts=4, sliding_window=16), "sliding_window = 16"),
        (moe_config("deepseek_v3"), "'deepseek_v3'"),
    ]
    for i, (config, needle) in enumerate(cases):
        folder = hf_folder(tmp_path / f"hf{i}", config)
        result = forge("convert", "from-hf", str(folder), "--out", str(tmp_path / "out"))
        assert result.exit_code == 2 and needle in said(result), (needle, said(result))
        assert no_leftovers(tmp_path / "out")


def test_a_bfloat16_moe_export_keeps_the_balancing_bias_in_fp32(tmp_path):
    """The bias only picks experts, where rounding it would change the choice; transformers keeps it fp32."""
    model = random_moe_model(model_config(**MOE_CONFIGS["sigmoid-shared"][0]))
    run = make_run(tmp_path / "run", model)
    report = export_to_hf(run, tmp_path / "hf", dtype="bfloat16")
    state = hf_state(tmp_path / "hf")
    bias = "model.layers.0.mlp.gate.e_score_correction_bias"
    assert state[bias].dtype == torch.float32 and torch.equal(state[bias], model.layers["0"].feed_forward.router.bias)
    assert {t.dtype for name, t in state.items() if name != bias and "e_score" not in name} == {torch.bfloat16}
    assert report.bytes == sum(t.nbytes for t in state.values())
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    assert torch.equal(hf.model.layers[0].mlp.gate.e_score_correction_bias, state[bias])


def test_to_hf_without_dtype_writes_the_runs_checkpoint_export_dtype(tmp_path):
    """A preset's checkpoint.export_dtype is what `forge convert to-hf` writes unless --dtype says otherwise."""
    model = random_model(model_config(**CONFIGS["mha"]))
    run = make_run(tmp_path / "run", model)
    cfg = JobConfig(model=model.cfg)
    cfg.checkpoint = cfg.checkpoint.model_copy(update={"export_dtype": "float16"})
    (run / "config.toml").write_text(dump_toml(cfg))
    for flags, dtype in [([], torch.float16), (["--dtype", "float32"], torch.float32)]:
        out = tmp_path / f"hf{len(flags)}"
        result = forge("convert", "to-hf", str(run), "--out", str(out), *flags)
        assert result.exit_code == 0, result.output
        with safe_open(out / "model.safetensors", framework="pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {dtype}
    assert resume_issues(JobConfig(model=model.cfg), cfg) == []  # a resumed run may change how it ships
