"""Multi-token prediction (DeepSeek-V3, engine/model/mtp.py): the training loss against the modules computed
by hand, evaluation and generation on the main model alone, the trainer's per-depth losses (falling, and
resumed bitwise), export leaving the modules out, and the combinations refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.config import load_job_config
from engine.config.model import ModelConfig
from engine.config.train import TrainConfig
from engine.errors import ConfigError
from engine.model.transformer import Transformer
from engine.plan import check_config
from engine.train.losses import build_loss

REPO = Path(__file__).resolve().parents[2]
SHAPE = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=32)


def by_hand(model: Transformer, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The main loss and each module's, written out from the modules' parts: module k reads the previous
    states at positions 0 … seq−k−1 and the embeddings of tokens k … seq−1, and predicts labels k … seq−1."""
    h = model.tok_embeddings(tokens)
    cos, sin = model.rope_cos, model.rope_sin
    for block in model.layers.values():
        h, _ = block(h, cos, sin)
    main = F.cross_entropy(model.output(model.norm(h)).flatten(0, 1), labels.flatten())
    depth, seq = [], tokens.shape[1]
    for k in range(1, model.cfg.mtp_depth + 1):
        module = model.mtp[str(k)]
        x = torch.cat([module.hidden_norm(h[:, : seq - k]), module.embed_norm(model.tok_embeddings(tokens[:, k:]))], -1)
        h, _ = module.block(module.proj(x), cos, sin)
        logits = model.output(module.norm(h))
        depth.append(F.cross_entropy(logits.flatten(0, 1), labels[:, k:].flatten()))
    return main, depth


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "chunked_cross_entropy"])
def test_training_loss_is_main_plus_weight_times_the_mean_module_loss(loss_fn):
    """float64 (the same algorithms, another order of the same sums: FP64 roundoff only): the total, the main
    loss and each depth's as the model records them; the eval loss (z_loss=False) is the main loss alone."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**SHAPE, mtp_depth=3, mtp_loss_weight=0.25, tie_embeddings=True))
        tokens, labels = torch.randint(0, 97, (2, 12)), torch.randint(0, 97, (2, 12))
        loss = build_loss(TrainConfig(loss_fn=loss_fn, ce_chunk_size=5))
        total = loss(model, tokens, labels)
        main, depth = by_hand(model, tokens, labels)
        assert len(depth) == 3 and len({round(d.item(), 6) for d in depth}) == 3
        expected = main + 0.25 * torch.stack(depth).mean()
        torch.testing.assert_close(total, expected, atol=1e-12, rtol=0)
        recorded, count = model.mtp_loss_window
        assert count == 1
        torch.testing.assert_close(recorded, torch.stack([main, *depth]).detach(), atol=1e-12, rtol=0)
        torch.testing.assert_close(loss(model, tokens, labels, z_loss=False), main, atol=1e-12, rtol=0)
    finally:
        torch.set_default_dtype(torch.float32)


def test_generation_and_evaluation_run_the_main_model_only():
    """The model's forward (what generation, evaluation and export use) is bitwise the model without the
    modules, loaded with the same weights; the modules get gradients only from the training loss."""
    torch.manual_seed(1)
    model = Transformer(ModelConfig(**SHAPE, mtp_depth=2))
    plain = Transformer(ModelConfig(**SHAPE))
    missing = plain.load_state_dict(model.state_dict(), strict=False)
    assert (
        missing.missing_keys == []
        and missing.unexpected_keys
        and all(k.startswith("mtp.") for k in missing.unexpected_keys)
    )
    tokens = torch.randint(0, 97, (2, 10))
    assert torch.equal(model(tokens), plain(tokens))
    cache = model.new_kv_cache(1, 16)
    assert torch.equal(model(tokens[:1], cache), plain(tokens[:1]))
    build_loss(TrainConfig(loss_fn="cross_entropy"))(model, tokens, tokens, z_loss=False).backward()
    assert all(p.grad is None for p in model.mtp.parameters())


TINY = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "train.seq_len=32",
    "model.max_seq_len=32",
    "train.batch_size=8",
    "train.max_steps=10",
    "metrics.log_interval=1",
    "eval.enabled=false",
    "scheduler.warmup_steps=1",
    "scheduler.decay_steps=9",
    "checkpoint.interval=5",
    "model.mtp_depth=2",
]


def test_trainer_logs_each_depth_loss_which_falls_and_resumes_bitwise(tmp_path):
    """presets/debug.toml with two modules, 10 steps on the embedded corpus: every step logs loss_main and
    mtp/loss_1, mtp/loss_2 with loss = main + weight × their mean (no MoE, no z-loss: exactly that sum, up to
    fp32 rounding of the sum of three numbers), each falls from the first steps to the last; a run stopped at
    step 5 and resumed logs the uninterrupted run's losses bitwise."""
    from engine.train.trainer import train

    def run(name: str, *extra: str) -> list[dict]:
        train(load_job_config(REPO / "presets" / "debug.toml", [*TINY, *extra]), tmp_path / name)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if "loss" in r]

    whole = run("whole")
    assert [r["step"] for r in whole] == list(range(1, 11))
    weight = ModelConfig().mtp_loss_weight
    for r in whole:
        total = r["loss_main"] + weight * (r["mtp/loss_1"] + r["mtp/loss_2"]) / 2
        assert r["loss"] == pytest.approx(total, rel=4 * 2**-24), r
    for key in ("loss_main", "mtp/loss_1", "mtp/loss_2"):
        first, last = sum(r[key] for r in whole[:3]) / 3, sum(r[key] for r in whole[-3:]) / 3
        assert last < first - 0.3, (key, first, last)
    run("resumed", "train.max_steps=5")
    resumed = run("resumed")
    keys = ("loss", "grad_norm", "loss_main", "mtp/loss_1", "mtp/loss_2")
    after = [[r[k] for k in keys] for r in resumed if r["step"] > 5]
    assert len(after) == 5 and after == [[r[k] for k in keys] for r in whole[5:]]
    exported_and_sampled_without_the_modules(tmp_path / "whole", tmp_path / "hf")


def exported_and_sampled_without_the_modules(run_dir: Path, out: Path) -> None:
    """`forge convert to-hf` of the MTP run says the modules are left out and writes the main model, whose
    logits transformers computes as Forge's main model does; `forge generate` says it samples the main model."""
    from typer.testing import CliRunner

    from engine.checkpoint.dcp import latest_checkpoint, load_checkpoint
    from forgecli.app import app
    from tests.helpers.parity import model_bound

    runner = CliRunner()
    result = runner.invoke(app, ["convert", "to-hf", str(run_dir), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert len(report["left_out"]) == 1 and "multi-token-prediction" in report["left_out"][0]
    model = Transformer(load_job_config(run_dir / "config.toml").model).eval()
    load_checkpoint(latest_checkpoint(run_dir / "checkpoints")[1], model)
    main = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("mtp."))
    assert report["parameters"] == main < model.num_parameters()
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16))
    with torch.no_grad():
        ours = model(tokens)
        gap = (hf(tokens).logits - ours).abs().max().item()
    assert gap <= model_bound(model.cfg, ours.abs().max().item())
    sampled = runner.invoke(app, ["generate", str(run_dir), "--prompt", "ROMEO:", "--max-new-tokens", "2"])
    assert sampled.exit_code == 0, sampled.output
    assert "sampling from the main model" in sampled.stderr


@pytest.mark.parametrize(
    "overrides,fields",
    [
        (["model.mtp_loss_weight=0.1"], ["model.mtp_loss_weight"]),
        (["model.mtp_depth=2", "distributed.cp=2"], ["distributed.cp"]),
        (["model.mtp_depth=2", "data.pack_sequences=true"], ["data.pack_sequences"]),
        (["model.mtp_depth=2", "lora.enabled=true"], ["lora.enabled"]),
        (["model.mtp_depth=300"], ["model.mtp_depth"]),
    ],
)
def test_combinations_multi_token_prediction_does_not_run_are_refused(overrides, fields):
    with pytest.raises(ConfigError) as err:
        check_config(load_job_config(REPO / "presets" / "debug.toml", overrides), 2)
    named = [issue.path for issue in err.value.issues]
    assert all(field in named for field in fields), named
    assert "mtp" in str(err.value)


@pytest.mark.parametrize("layout", [["distributed.tp=2"], ["distributed.pp=2", "train.grad_accum_steps=2"]])
def test_tensor_and_pipeline_parallelism_take_multi_token_prediction(layout):
    """tp = 2 and pp = 2 validate with the modules (their parity with one process: tests/parallel/test_tensor_parallel.py's *_mtp
    cases, tests/parallel/test_pipeline_mtp.py)."""
    overrides = ["model.mtp_depth=2", *layout, "distributed.dp_shard=1"]
    cfg = check_config(load_job_config(REPO / "presets" / "debug.toml", overrides), 2)
    assert cfg.model.mtp_depth == 2 and max(cfg.distributed.tp, cfg.distributed.pp) == 2
