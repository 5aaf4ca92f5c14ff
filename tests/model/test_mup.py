"""μP (engine/model/mup.py): the coordinate check of Tensor Programs V, the multipliers against their
definition, export to transformers, bitwise resume, and the config refusals.

The coordinate check trains the same tiny shape at widths 64 … 1024 for a few AdamW steps and fits the
slope of log RMS(activation) against log width for every layer and step: under μP every layer's activations
stay the same size as the model widens (|slope| < 0.1); under sp (Forge's fixed init std) they do not.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.checkpoint.dcp import latest_checkpoint
from engine.checkpoint.hf import export_to_hf
from engine.checkpoint.hf_lora import export_adapters
from engine.checkpoint.manager import initialize_from
from engine.config import load_job_config
from engine.config.lora import LoraConfig
from engine.config.model import ModelConfig
from engine.config.optimizer import OptimizerConfig
from engine.errors import ConfigError, UserError
from engine.model import build_model
from engine.model.lora import apply_lora, is_adapter_weight
from engine.model.mup import mup_plan
from engine.model.rope import apply_rope
from engine.plan import check_config
from engine.train.losses import cross_entropy
from engine.train.optim import build_optimizer, current_lr
from engine.train.run_dir import run_config
from engine.train.trainer import train
from tests.helpers.parity import FP64_TOL, model_bound

WIDTHS = (64, 128, 256, 512, 1024)
HEAD_DIM = 16
COORD_STEPS = 5
VOCAB, SEQ, BATCH = 64, 16, 2


def coord_config(width: int, parametrization: str) -> ModelConfig:
    """Width grows by heads of a fixed size, the FFN in proportion (= dim): every hidden dimension scales."""
    mup = {"mup_base_dim": WIDTHS[0]} if parametrization == "mup" else {}
    return ModelConfig(
        dim=width,
        n_layers=2,
        n_heads=width // HEAD_DIM,
        vocab_size=VOCAB,
        ffn_hidden_dim=width,
        max_seq_len=SEQ,
        parametrization=parametrization,
        **mup,
    )


ADAMW = OptimizerConfig(lr=1e-3, weight_decay=0.0)


def activation_rms(width: int, parametrization: str, optimizer: OptimizerConfig = ADAMW) -> dict[str, list[float]]:
    """Module name → RMS of its output on a fixed batch after each of steps 1 … COORD_STEPS of `optimizer`."""
    torch.manual_seed(0)
    model = build_model(coord_config(width, parametrization))
    watched = {"tok_embeddings": model.tok_embeddings, "output": model.output}
    for name, block in model.layers.items():
        watched |= {f"layers.{name}": block, f"layers.{name}.attention": block.attention}
        watched[f"layers.{name}.feed_forward"] = block.feed_forward
    seen: dict[str, list[float]] = {name: [] for name in watched}
    recording = [False]

    def hook(name: str):
        def record(module, inputs, output) -> None:
            if recording[0]:
                tensor = output[0] if isinstance(output, tuple) else output  # a block: (hidden, MoE stats)
                seen[name].append(tensor.detach().pow(2).mean().sqrt().item())

        return record

    for name, module in watched.items():
        module.register_forward_hook(hook(name))
    optimizer = build_optimizer(model, optimizer)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    for _ in range(COORD_STEPS):
        cross_entropy(model(data[:, :-1]), data[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
        recording[0] = True
        with torch.no_grad():
            model(data[:, :-1])
        recording[0] = False
    return seen


def slopes(parametrization: str, optimizer: OptimizerConfig = ADAMW) -> dict[tuple[str, int], float]:
    """(module, step) → slope of log RMS against log width over WIDTHS."""
    runs = [activation_rms(width, parametrization, optimizer) for width in WIDTHS]
    x = np.log(WIDTHS)
    out = {}
    for name in runs[0]:
        assert all(len(run[name]) == COORD_STEPS for run in runs), name
        for step in range(COORD_STEPS):
            out[(name, step + 1)] = float(np.polyfit(x, np.log([run[name][step] for run in runs]), 1)[0])
    return out


def test_coordinate_check_flat_under_mup_not_under_sp():
    """AdamW at lr 1e-3, where five steps move every layer (the logits start at zero under μP, so theirs are
    all update) without leaving the regime the μP limit describes; sp's slopes reach ~1.9 here, μP's stay
    within ~0.03 (benchmarks/results/mup_transfer.md lists them all)."""
    mup, sp = slopes("mup"), slopes("sp")
    assert len(mup) == len(sp) == 8 * COORD_STEPS  # embeddings, head, 2 × (block, attention, feed-forward)
    worst_mup = max(mup, key=lambda k: abs(mup[k]))
    worst_sp = max(sp, key=lambda k: abs(sp[k]))
    print(f"worst |slope|: mup {worst_mup} {mup[worst_mup]:+.3f}, sp {worst_sp} {sp[worst_sp]:+.3f}")
    assert abs(mup[worst_mup]) < 0.1, mup
    assert abs(sp[worst_sp]) > 0.3, sp  # sp's activations grow (or its logits blow up) with width


def test_coordinate_check_flat_under_mup_with_muon():
    """Muon at lr 1e-2: under μP its hidden matrices' lr × sqrt(base_fan_in / fan_in) keeps every |slope|
    below the AdamW check's 0.1 (0.05 here); Adam's factor (base_fan_in / fan_in) gives −0.18, none 0.84, and
    sp ~1.9 (engine/model/mup.py's module docstring gives the spectral argument)."""
    muon = OptimizerConfig.model_validate({"name": "muon", "lr": 1e-2, "weight_decay": 0.0})
    mup, sp = slopes("mup", muon), slopes("sp", muon)
    worst_mup = max(mup, key=lambda k: abs(mup[k]))
    print(f"worst |slope| under muon: mup {worst_mup} {mup[worst_mup]:+.3f}, sp {max(map(abs, sp.values())):.3f}")
    assert abs(mup[worst_mup]) < 0.1, mup
    assert max(map(abs, sp.values())) > 0.3, sp


@pytest.mark.parametrize(
    "shape",
    [
        dict(dim=64, n_heads=4, mup_base_dim=16),  # head_dim 16
        dict(dim=96, n_heads=2, n_kv_heads=1, attention_head_dim=12, mup_base_dim=32),  # head_dim ≠ dim / n_heads
        dict(dim=128, n_heads=2, mup_base_dim=128),  # head_dim 64, at the base width
    ],
    ids=["head16", "head12-gqa", "head64-base"],
)
def test_attention_scores_are_scaled_by_the_closed_form(shape, parity):
    """The attention kernel's scores are q·k · 1/head_dim under μP and q·k · 1/√head_dim under sp (TP V;
    engine/model/mup.py: the same at every width, the base's included), from the config's head_dim: the
    plan's attention_scale, and what the first block's attention computes: its core's output against
    softmax(q·kᵀ·scale + causal mask)·v, with q and k the block's projections of its input after RoPE (before
    any scaling), in float64 (the same function: within parity.FP64_TOL)."""
    for parametrization in ("sp", "mup"):
        fields = shape if parametrization == "mup" else {k: v for k, v in shape.items() if k != "mup_base_dim"}
        cfg = ModelConfig(n_layers=1, vocab_size=VOCAB, parametrization=parametrization, **fields)
        scale = 1 / cfg.head_dim if parametrization == "mup" else 1 / math.sqrt(cfg.head_dim)
        if parametrization == "mup":
            assert mup_plan(cfg).attention_scale == scale
        torch.manual_seed(0)
        model = build_model(cfg).double()
        attention = model.layers["0"].attention
        inputs, seen = [], []
        attention.register_forward_pre_hook(lambda module, args, inputs=inputs: inputs.append(args[:3]))
        attention.core.register_forward_hook(lambda module, args, out, seen=seen: seen.append((args[2], out)))
        with torch.no_grad():
            model(torch.randint(0, VOCAB, (BATCH, SEQ)))
            [(x, cos, sin)], [(v, out)] = inputs, seen
            q, k = (
                apply_rope(w(x).view(BATCH, SEQ, -1, cfg.head_dim).transpose(1, 2), cos, sin)
                for w in (attention.wq, attention.wk)
            )
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = q @ k.transpose(-1, -2) * scale
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        expected = scores.masked_fill(~causal, -math.inf).softmax(-1) @ v
        parity.close(out, expected, atol=FP64_TOL, what=f"{parametrization} attention")


def test_the_plan_scales_hidden_matrices_by_their_fan_in_and_the_model_and_optimizer_apply_it():
    """dim 256 over a base of 64 (m = 4), FFN 3·dim: every hidden matrix reads a width 4× the base's, so init
    std × 1/2 and lr × 1/4; embeddings and norms × 1; the untied head starts at zero; logits × 1/4."""
    cfg = ModelConfig(
        dim=256, n_layers=2, n_heads=8, vocab_size=VOCAB, ffn_hidden_dim=768, parametrization="mup", mup_base_dim=64
    )
    plan = mup_plan(cfg)
    assert (plan.width_mult, plan.output_multiplier, plan.attention_scale) == (4.0, 0.25, 1 / 32)
    hidden = [name for name in plan.params if name.startswith("layers.") and name.endswith(("wq.weight", "w2.weight"))]
    assert len(hidden) == 4 and all((plan.params[n].init, plan.params[n].lr) == (0.5, 0.25) for n in hidden)
    assert (plan.params["tok_embeddings.weight"].init, plan.params["tok_embeddings.weight"].lr) == (1.0, 1.0)
    assert (plan.params["norm.weight"].lr, plan.params["output.weight"].init, plan.params["output.weight"].lr) == (
        1,
        0,
        1,
    )

    torch.manual_seed(0)
    sp_model = build_model(cfg.model_copy(update={"parametrization": "sp", "mup_base_dim": None}))
    torch.manual_seed(0)
    model = build_model(cfg)
    # The same random numbers, times the init multiplier (so the std is exactly init_std · 1/2 as drawn).
    assert torch.equal(model.layers["0"].attention.wq.weight, sp_model.layers["0"].attention.wq.weight * 0.5)
    assert torch.equal(model.tok_embeddings.weight, sp_model.tok_embeddings.weight)
    assert not model.output.weight.any()
    assert model.layers["0"].attention.query_scale == pytest.approx(1 / math.sqrt(32))
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-3))
    lr_of = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    named = dict(model.named_parameters())
    assert len(lr_of) == len(named)
    assert lr_of[id(named["layers.1.feed_forward.w2.weight"])] == pytest.approx(2.5e-4)
    assert lr_of[id(named["tok_embeddings.weight"])] == lr_of[id(named["output.weight"])] == 1e-3
    assert current_lr(optimizer) == 1e-3  # metrics report the base lr

    apply_lora(model, LoraConfig(enabled=True))  # adapters (width × rank) train at the base lr
    adapters = [p for name, p in model.named_parameters() if is_adapter_weight(name)]
    groups = build_optimizer(model, OptimizerConfig(lr=1e-3)).param_groups
    assert len(adapters) == 16 and sum(len(g["params"]) for g in groups) == 16
    assert all(g["lr"] == 1e-3 for g in groups)


def export_case(**fields) -> ModelConfig:
    return ModelConfig(vocab_size=151, max_seq_len=64, parametrization="mup", **fields)


@pytest.mark.parametrize(
    "cfg",
    [
        export_case(dim=64, n_layers=2, n_heads=4, mup_base_dim=16),  # query scale folded into q_proj
        export_case(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, qk_norm=True, tie_embeddings=True, mup_base_dim=32),
    ],
    ids=["untied", "qk_norm-tied"],
)
def test_a_mup_export_gives_transformers_the_same_logits(tmp_path, cfg, parity):
    """The query scale and the logit multiplier are folded into q_proj (or q_norm) and the final norm. The
    weights are spread as in tests/checkpoint/test_convert.py's random_model, the zero head given values (as training
    would), so that every fold matters."""
    from tests.helpers.convert import assert_same_as_transformers, hf_model, make_run, random_model

    model = random_model(cfg)
    with torch.no_grad():
        model.output.weight.normal_(0, 0.5)
    export_to_hf(make_run(tmp_path / "run", model.eval()), tmp_path / "hf")
    hf = hf_model(tmp_path / "hf")
    # Compared in float64 (assert_same_logits, within FP64_TOL): the folds multiply fp32 weights by powers of
    # two here (the query scale 1/4 of sp's, the logit multiplier 1/4 or 1/2), exact in the exported fp32.
    assert_same_as_transformers(parity, hf, model, seq=40, prompt=8, new_tokens=24)
    assert not torch.equal(hf.model.norm.weight, model.norm.weight)  # the multiplier went into the export


RESUME = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.parametrization='mup'",
    "model.mup_base_dim=32",
    "train.seq_len=32",
    "model.max_seq_len=32",
    "train.batch_size=2",
    "metrics.log_interval=1",
    "eval.enabled=false",
    "scheduler.warmup_steps=1",
    "scheduler.decay_steps=4",
    "checkpoint.interval=3",
]


def logged(run_dir: Path) -> list[tuple]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in map(json.loads, lines) if "loss" in r]


def test_a_mup_run_resumes_bitwise(tmp_path):
    preset = Path(__file__).parents[2] / "presets" / "debug.toml"
    train(load_job_config(preset, [*RESUME, "train.max_steps=6"]), tmp_path / "whole")
    train(load_job_config(preset, [*RESUME, "train.max_steps=3"]), tmp_path / "parts")
    train(run_config(tmp_path / "parts", ["train.max_steps=6"]), tmp_path / "parts")
    whole = logged(tmp_path / "whole")
    assert [r[0] for r in whole] == [1, 2, 3, 4, 5, 6]
    assert logged(tmp_path / "parts") == whole
    assert whole[2][3] == 2e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 1 / 4)))  # the base lr is logged
    ours, theirs = (weights(tmp_path / name) for name in ("parts", "whole"))
    assert len(ours) == len(theirs) > 0 and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    # Its checkpoints say what their weights mean, and a new run of another parametrization or base width is
    # refused them (they would load by shape and compute another function); the same model loads them.
    checkpoint = latest_checkpoint(tmp_path / "whole" / "checkpoints")[1]
    assert json.loads((checkpoint / "train_state.json").read_text())["parametrization"] == "mup@32"
    model = load_job_config(tmp_path / "whole" / "config.toml").model
    for other, shown in [({"parametrization": "sp", "mup_base_dim": None}, "'sp'"), ({"mup_base_dim": 16}, "'mup@16'")]:
        with pytest.raises(UserError, match=rf"parametrization 'mup@32', and this run's model is {shown}"):
            initialize_from(checkpoint, build_model(model.model_copy(update=other)), [])
    assert initialize_from(checkpoint, build_model(model), [])


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from engine.checkpoint.dcp import load_checkpoint

    model = build_model(load_job_config(run_dir / "config.toml").model)
    load_checkpoint(latest_checkpoint(run_dir / "checkpoints")[1], model)
    return model.state_dict()


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.mup_base_dim=512"], "larger than dim"),
        (["model.mup_base_dim=64", "model.ffn_hidden_dim=500"], "is not a whole number"),
    ],
)
def test_bad_mup_settings_are_refused(overrides, needle):
    preset = Path(__file__).parents[2] / "presets" / "debug.toml"
    with pytest.raises(ConfigError, match=needle):
        check_config(load_job_config(preset, ["model.parametrization='mup'", *overrides]))


def test_a_mup_lora_adapter_export_gives_peft_our_logits(tmp_path, parity):
    """--adapters-only under μP: q_proj is exported times the query scale, so its lora_B is too; peft on the
    exported base then computes the adapted model's logits (within model_bound, two more reductions per
    adapted linear as in tests/model/test_lora.py)."""
    import peft

    from tests.helpers.convert import hf_model, make_run, random_model
    from tests.helpers.lora import save_lora_run

    cfg = export_case(dim=64, n_layers=2, n_heads=4, mup_base_dim=16)
    base = random_model(cfg)
    with torch.no_grad():
        base.output.weight.normal_(0, 0.5)
    export_to_hf(make_run(tmp_path / "base-run", base), tmp_path / "base-hf")
    lora = LoraConfig(enabled=True, rank=4, alpha=8.0)
    apply_lora(base, lora)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.3)
    export_adapters(save_lora_run(tmp_path / "run", base, lora), tmp_path / "adapter")
    theirs = peft.PeftModel.from_pretrained(hf_model(tmp_path / "base-hf"), tmp_path / "adapter")
    tokens = torch.randint(0, 151, (2, 24))
    with torch.no_grad():
        ours = base(tokens)
        bound = model_bound(cfg, ours.abs().max().item(), extra=2)
        parity.close(theirs(tokens).logits, ours, atol=bound, what="peft logits")
