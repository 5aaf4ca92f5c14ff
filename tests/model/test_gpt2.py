"""The GPT-2 family (engine/model/families/gpt2/): its spec against the built model, logits equal to
`transformers`' GPT2LMHeadModel both ways (random HF weights imported; a Forge model exported, its fused
c_attn and Conv1D weights included), and the fields and configurations it refuses (exit 2, naming both).
Its layouts are in tests/parallel/test_gpt2_layouts.py, its memory estimate in tests/parallel/test_memory_estimate.py."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from typer.testing import CliRunner

from engine.checkpoint.dcp import load_checkpoint
from engine.checkpoint.hf import export_to_hf, import_from_hf
from engine.checkpoint.hf_mapping import hf_architecture
from engine.config.loader import load_job_config
from engine.config.model import ModelConfig
from engine.errors import ConfigError, UserError
from engine.generate import Sampling, generate
from engine.model import build_model
from engine.model.documents import document_ids
from engine.model.estimate import param_counts, training_flops_per_token
from engine.model.families.gpt2.model import GPT2
from engine.parallel.memory import param_specs
from engine.plan import check_config
from forgecli.app import app
from tests.conftest import REPO
from tests.helpers.convert import make_run
from tests.helpers.parity import FP64_TOL, SIGMAS, Parity

transformers = pytest.importorskip("transformers")

VOCAB = 97
PRESET = REPO / "presets" / "gpt2_124m.toml"


def gpt2_config(**fields) -> ModelConfig:
    return ModelConfig(
        **{"model_type": "gpt2", "dim": 32, "n_layers": 2, "n_heads": 4, "vocab_size": VOCAB, "max_seq_len": 24}
        | fields
    )


def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter random (biases and LayerNorms away from 0 and 1 too), matrices scaled up for sharp
    distributions (no near-ties in greedy decoding), so that every tensor's mapping matters."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.3)
            else:
                p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def test_the_spec_describes_the_built_model():
    """param_specs, the counts and the FLOPs against the module: names, shapes and order of every parameter,
    the total, and 6 × every matmul weight (the head once, tied or not) + attention's 12·L·d·s."""
    for tied in (True, False):
        cfg = gpt2_config(tie_embeddings=tied, ffn_hidden_dim=40)
        model = build_model(cfg)
        assert type(model) is GPT2
        real = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        assert [(s.name, s.shape) for s in param_specs(cfg)] == real and len(real) == 2 + 2 * 16 + 2 + (not tied)
        counts = param_counts(cfg)
        assert (
            counts["total"] == model.num_parameters() == counts["embedding"] + counts["blocks"] + counts["output_head"]
        )
        matmuls = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
        assert training_flops_per_token(cfg, 16) == 6 * matmuls + 12 * 2 * 32 * 16
    assert gpt2_config().ffn_dim == 4 * 32  # GPT-2's width when ffn_hidden_dim is unset


def assert_logits_equal(parity: Parity, hf, model, what: str) -> None:
    """Logits of random tokens, in float64 on both sides (GPT-2 has no fp32 islands in either library: its
    norms are LayerNorms, its positions a learned table): the same function, within parity.FP64_TOL."""
    tokens = torch.randint(0, VOCAB, (2, model.cfg.max_seq_len))
    with torch.no_grad():
        ours = copy.deepcopy(model).double()(tokens)
        parity.close(copy.deepcopy(hf).double()(tokens).logits, ours, atol=FP64_TOL, what=what)


def test_random_transformers_weights_import_to_the_same_logits(tmp_path, parity):
    """A GPT2LMHeadModel made by transformers with random weights (tied head, the default n_inner), saved
    and imported by `forge convert from-hf`: the Forge model computes its logits; the fused c_attn lands in
    wq/wk/wv, the Conv1D weights transposed."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=24, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.1, attn_pdrop=0.1
    )
    torch.manual_seed(0)
    hf = randomized(transformers.GPT2LMHeadModel(config), 0)
    hf.save_pretrained(tmp_path / "hf")
    report = import_from_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert report.architecture == "GPT2LMHeadModel"
    cfg = report.model
    assert (cfg.model_type, cfg.ffn_dim, cfg.max_seq_len, cfg.tie_embeddings) == ("gpt2", 128, 24, True)
    model = build_model(cfg)
    load_checkpoint(tmp_path / "ckpt" / "step_0", model)
    q, k, v = hf.transformer.h[1].attn.c_attn.weight.split(32, dim=1)
    attention = model.layers["1"].attention
    assert all(
        torch.equal(ours.weight, theirs.T)
        for ours, theirs in zip((attention.wq, attention.wk, attention.wv), (q, k, v))
    )
    assert_logits_equal(parity, hf, model.eval(), "imported logits")


def test_a_forge_model_exports_to_transformers_and_back(tmp_path, parity):
    """A random Forge GPT-2 (untied head, explicit FFN width) exported in several files (a fused c_attn's
    three sources are read together): transformers loads it as GPT2LMHeadModel and computes the same logits
    and the same greedy continuation (Forge's through its KV cache); imported back, bitwise the same weights."""
    model = randomized(build_model(gpt2_config(tie_embeddings=False, ffn_hidden_dim=48)), 1)
    export_to_hf(make_run(tmp_path / "run", model), tmp_path / "hf", max_shard_bytes=12_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel" and hf.config.n_inner == 48
    assert_logits_equal(parity, hf, model, "exported logits")
    prompt = torch.randint(0, VOCAB, (1, 6))
    theirs = hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, 6:].tolist()
    assert list(generate(model, prompt[0].tolist(), 12, Sampling(temperature=0))) == theirs
    import_from_hf(tmp_path / "hf", tmp_path / "back")
    back = build_model(model.cfg)
    load_checkpoint(tmp_path / "back" / "step_0", back)
    expected = model.state_dict()
    assert sorted(back.state_dict()) == sorted(expected)
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_a_folder_named_as_openai_saved_gpt2_imports_as_the_prefixed_one(tmp_path):
    """OpenAI's GPT-2 checkpoints on the Hub name their tensors without the `transformer.` prefix
    (`wte.weight`, `h.0.attn.c_attn.weight`, plus each block's `attn.bias` mask buffer), which transformers
    loads: the same weights, so the same Forge checkpoint as the prefixed folder's, bit for bit."""
    from safetensors.torch import load_file, save_file

    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=24, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    randomized(transformers.GPT2LMHeadModel(config), 0).save_pretrained(tmp_path / "prefixed")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tmp_path / "prefixed" / "config.json").read_text())
    tensors = load_file(tmp_path / "prefixed" / "model.safetensors")
    stripped = {name.removeprefix("transformer."): t for name, t in tensors.items() if name != "lm_head.weight"}
    stripped |= {f"h.{i}.attn.bias": torch.tril(torch.ones(1, 1, 24, 24)) for i in range(2)}
    assert "wte.weight" in stripped and not any(name.startswith("transformer.") for name in stripped)
    save_file(stripped, bare / "model.safetensors")
    states = []
    for folder in ("prefixed", "bare"):
        import_from_hf(tmp_path / folder, tmp_path / f"{folder}-ckpt")
        model = build_model(gpt2_config())
        load_checkpoint(tmp_path / f"{folder}-ckpt" / "step_0", model)
        states.append(model.state_dict())
    assert len(states[1]) == len(states[0]) == 2 + 2 * 16 + 2 + 1  # (+ the tied head's name)
    assert all(torch.equal(states[1][name], states[0][name]) for name in states[0])


def test_transformers_configurations_forge_does_not_compute_are_refused(tmp_path):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=24, n_embd=32, n_layer=1, n_head=4)
    for key, value in (("activation_function", "relu"), ("scale_attn_by_inverse_layer_idx", True)):
        folder = tmp_path / key
        transformers.GPT2LMHeadModel(config).save_pretrained(folder)
        (folder / "config.json").write_text(
            json.dumps({**json.loads((folder / "config.json").read_text()), key: value})
        )
        with pytest.raises(UserError, match=key):
            import_from_hf(folder, tmp_path / f"{key}-out")
        assert not (tmp_path / f"{key}-out").exists()
    # and a checkpoint config with a field of another family (one config validation would refuse) does not export
    with pytest.raises(UserError, match=r"model\.qk_norm is set, but model\.model_type = 'gpt2'"):
        hf_architecture(gpt2_config(qk_norm=True))


REFUSED = {
    "model.qk_norm": "true",
    "model.rope_theta": "500000",
    "model.num_experts": "4",
    "model.moe_top_k": "1",
    "model.norm_type": "'layernorm'",
    "model.n_kv_heads": "2",
    "model.ffn_dim_multiplier": "1.5",
    "model.activation": "'gelu'",
}


def test_fields_gpt2_has_no_use_for_are_refused_naming_field_and_family():
    """Each field of another family, set with gpt2, is one issue naming it and the family (an MoE field once:
    not also as a dense model's), and LoRA, whose adapters drop biases, is refused as a combination."""
    with pytest.raises(ConfigError) as caught:
        check_config(load_job_config(PRESET, [f"{k}={v}" for k, v in REFUSED.items()] + ["lora.enabled=true"]), 8)
    issues = {issue.path: issue.problem for issue in caught.value.issues}
    assert sorted(issues) == sorted([*REFUSED, "lora.enabled"]), issues
    assert all("model.model_type = 'gpt2'" in problem for problem in issues.values())
    check_config(load_job_config(PRESET), 8)  # and the preset itself validates for the layout it declares


def test_a_refused_field_exits_2_from_the_cli():
    result = CliRunner().invoke(
        app, ["validate-config", str(PRESET), "--model.qk_norm=true"], env={"COLUMNS": "200", "NO_COLOR": "1"}
    )
    assert result.exit_code == 2 and "model.qk_norm" in result.output and "'gpt2'" in result.output, result.output


def test_packed_documents_restart_positions_and_attend_within_their_document(parity):
    """A window of three documents (ended by token 0) computes, per document, the logits that document gets
    alone: the position embedding restarts at each document's first token, attention stays inside it. float64,
    the claim being the same function: within parity.FP64_TOL."""
    model = randomized(build_model(gpt2_config()), 2).double()
    window = torch.tensor([[5, 9, 0, 7, 3, 8, 0, 4, 6, 2, 1, 11]])
    with torch.no_grad():
        packed = model(window, doc_ids=document_ids(window, 0))
        alone = torch.cat([model(window[:, a:b]) for a, b in ((0, 3), (3, 7), (7, 12))], dim=1)
    parity.close(packed, alone, atol=FP64_TOL, what="packed logits")


def test_the_trainer_trains_evaluates_and_checkpoints_a_gpt2_run(tmp_path):
    """`forge train`'s path in one process (engine.train.trainer.train: the model built by its family,
    parallelize without a mesh, loss, evaluation, checkpoint) on a tiny GPT-2: the loss falls over 6 steps
    at lr 3e-3, evaluation runs, and the checkpoint holds GPT-2's weights, moved from their initial values."""
    from engine.train.job import initial_model
    from engine.train.trainer import train

    overrides = [
        "model.model_type='gpt2'",
        "model.dim=32",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.tie_embeddings=true",
        "train.seq_len=32",
        "model.max_seq_len=32",
        "train.batch_size=4",
        "train.max_steps=6",
        "train.mixed_precision='fp32'",
        "optimizer.lr=3e-3",
        "scheduler.warmup_steps=1",
        "metrics.log_interval=1",
        "eval.interval=6",
        "eval.steps=1",
        "checkpoint.interval=6",
    ]
    cfg = load_job_config(REPO / "presets" / "debug.toml", overrides)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"n_kv_heads": None})})
    train(cfg, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses
    assert [r["step"] for r in records if "eval_loss" in r] == [6]
    model = build_model(cfg.model)
    load_checkpoint(tmp_path / "run" / "checkpoints" / "step_6", model)
    start = initial_model(cfg, True).state_dict()
    assert sorted(model.state_dict()) == sorted(start)
    assert not torch.equal(model.pos_embeddings.weight, start["pos_embeddings.weight"])


def test_initialisation_is_gpt2s_closed_form():
    """GPT-2's initialisation (Radford et al. 2019 §2.3; OpenAI's model.py and transformers' GPT2 `_init_weights`):
    every embedding and linear weight Normal(0, init_std), the projections writing into the residual stream
    (attention wo, MLP w2) at init_std/√(2·n_layers), every linear bias exactly zero, LayerNorms at weight 1
    and bias 0. Each weight tensor's sample mean and standard deviation against the closed form: n draws of
    Normal(0, s) have a sample mean of standard deviation s/√n and a sample std of relative standard deviation
    1/√(2(n−1)), so SIGMAS of those (a 2e-9 chance of a false failure per check); with 8 layers the residual
    projections' std is 4× smaller than the others', far outside that bound (≤ 10% here)."""
    std, n_layers = 0.05, 8
    torch.manual_seed(0)
    model = build_model(gpt2_config(n_layers=n_layers, dim=64, tie_embeddings=False, init_std=std))
    residual_std = std / math.sqrt(2 * n_layers)
    checked = set()
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name:
            assert torch.equal(p, torch.full_like(p, 1.0 if leaf == "weight" else 0.0)), name
        elif leaf == "bias":
            assert torch.equal(p, torch.zeros_like(p)), f"{name} is not zero"
        else:
            expected = residual_std if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else std
            n = p.numel()
            assert abs(p.mean().item()) <= SIGMAS * expected / math.sqrt(n), name
            relative = abs(p.std().item() / expected - 1)
            assert relative <= SIGMAS / math.sqrt(2 * (n - 1)), f"{name}: std off by {relative:.3g} of {expected}"
        checked.add(name)
    assert checked == set(model.state_dict()) and len(checked) == 2 + 16 * n_layers + 2 + 1
