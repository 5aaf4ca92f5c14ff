"""LoRA and QLoRA (engine/model/lora.py): parity with `peft`, training that changes only the adapters,
merging, adapters-only checkpoints and exact resume, exports peft loads, NF4 bases, FSDP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from engine.checkpoint.dcp import SafeFileSystemReader, latest_checkpoint, load_checkpoint, read_state
from engine.checkpoint.hf import export_to_hf, load_hf_weights
from engine.checkpoint.hf_lora import export_adapters, import_with_adapter, module_names
from engine.config import JobConfig, load_job_config
from engine.config.lora import LoraConfig
from engine.generate import load_model
from engine.model.lora import LoRALinear, apply_lora
from engine.model.transformer import Transformer
from engine.train.lora_merge import merge_adapters
from forgecli.app import app
from tests.helpers.convert import VOCAB, hf_model, make_run, model_config, random_model
from tests.helpers.lora import save_lora_run
from tests.helpers.parity import FP64_TOL, model_bound
from tests.helpers.trainer import TINY

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PRESET = Path(__file__).parents[2] / "presets" / "debug.toml"
TARGETS = {
    "attention": ["layers.*.attention.w[qkvo]"],
    "all-linear": ["layers.*.attention.*", "layers.*.feed_forward.*", "output"],
}
SHAPE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2)


def lora_model(targets: list[str], seed: int = 0, **lora) -> tuple[Transformer, LoraConfig]:
    """A random base with adapters whose B is random too (B = 0 would hide a wrong B or scaling)."""
    model = random_model(model_config(**SHAPE), seed)
    cfg = LoraConfig(enabled=True, rank=4, alpha=8.0, target_modules=targets, **lora)
    apply_lora(model, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.3)
    return model, cfg


def loss_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


@pytest.mark.parametrize("name", list(TARGETS))
def test_peft_gives_our_logits_and_adapter_gradients_and_the_exports_agree(tmp_path, name, parity):
    """Our export of the base + our --adapters-only export, loaded by PeftModel.from_pretrained, computes our
    logits and our adapters' gradients; --merge gives the same logits as a plain model; and from-hf --adapter
    imports the same merged weights back.

    fp32 throughout (the exports are fp32), so each comparison is within parity.model_bound: peft and the
    merged weights order the sums differently (W + s·BA against Wx + s·B(Ax): two more reductions of ≤ rank
    or dim terms per adapted linear, `extra`), scaled by the largest |logit| or |gradient|. About 1e-3 here:
    rounding moved 1.2e-5 at most on two CPUs, a wrong scaling or transpose moves the logits by whole units."""
    base = random_model(model_config(**SHAPE))
    export_to_hf(make_run(tmp_path / "base-run", base), tmp_path / "base-hf")
    model, lora = lora_model(TARGETS[name])
    run = save_lora_run(tmp_path / "run", model, lora)
    export_adapters(run, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert len(config["target_modules"]) == (8 if name == "attention" else 2 * 7 + 1)

    theirs = peft.PeftModel.from_pretrained(hf_model(tmp_path / "base-hf"), tmp_path / "adapter", is_trainable=True)
    tokens = torch.randint(0, VOCAB, (2, 24))
    ours_logits, their_logits = model(tokens), theirs(tokens).logits
    logit_tol = model_bound(model.cfg, ours_logits.abs().max().item(), extra=2)
    parity.close(their_logits, ours_logits, atol=logit_tol, what="peft logits")
    loss_of(ours_logits, tokens).backward()
    loss_of(their_logits, tokens).backward()
    their_params = dict(theirs.named_parameters())
    adapted = [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert len(adapted) == len(config["target_modules"])
    hf_names = module_names(model.cfg)
    assert sorted(config["target_modules"]) == sorted(hf_names[n] for n, _ in adapted)
    for module_name, module in adapted:
        for part in ("lora_A", "lora_B"):
            their = their_params[f"base_model.model.{hf_names[module_name]}.{part}.default.weight"]
            ours = getattr(module, part).grad
            assert ours.abs().sum() > 0
            grad_tol = model_bound(model.cfg, ours.abs().max().item(), backward=True, extra=2)
            parity.close(their.grad, ours, atol=grad_tol, what=f"peft grad {module_name}.{part}")
    assert all(p.grad is None for n, p in model.named_parameters() if not n.endswith(("lora_A", "lora_B")))

    export_to_hf(run, tmp_path / "merged", merge=True)
    sampler, _ = load_model(run, torch.device("cpu"))  # forge generate's model: the adapters merged in
    with torch.no_grad():
        parity.close(sampler(tokens), ours_logits, atol=logit_tol, what="merged (forge generate) logits")
    with torch.no_grad():
        merged_hf = hf_model(tmp_path / "merged")(tokens).logits
        parity.close(merged_hf, ours_logits, atol=logit_tol, what="merged export logits")
        imported = Transformer(model.cfg)
        import_with_adapter(tmp_path / "base-hf", tmp_path / "adapter", tmp_path / "imported")
        load_hf_weights(imported, tmp_path / "merged")  # the merged export …
        merged_logits = imported(tokens)
        load_checkpoint(tmp_path / "imported" / "step_0", imported)  # … equals base + peft adapter imported
        parity.close(imported(tokens), merged_logits, atol=logit_tol, what="imported adapter logits")


def test_a_lora_run_exports_only_merged_or_as_an_adapter(tmp_path):
    model, lora = lora_model(TARGETS["attention"])
    run = save_lora_run(tmp_path / "run", model, lora)
    runner = CliRunner()
    plain = runner.invoke(app, ["convert", "to-hf", str(run), "--out", str(tmp_path / "out")])
    assert plain.exit_code == 2 and "--merge" in plain.output and not (tmp_path / "out").exists()
    result = runner.invoke(
        app, ["convert", "to-hf", str(run), "--out", str(tmp_path / "a"), "--adapters-only", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": True})
    )
    export_to_hf(make_run(tmp_path / "base-run", random_model(model_config(**SHAPE))), tmp_path / "base-hf")
    refused = runner.invoke(
        app, ["convert", "from-hf", str(tmp_path / "base-hf"), "--adapter", str(bad), "--out", str(tmp_path / "x")]
    )
    assert refused.exit_code == 2 and "use_dora" in refused.output and not (tmp_path / "x").exists()


def test_step_zero_is_the_base_and_a_merge_keeps_the_function(parity):
    """B = 0 at the start: the loss is the base model's bit for bit. Merging folds B·A into the base and restarts
    the adapter: the same loss (float64: only the order of the sums changes), B = 0 again, the optimizer state
    zeroed when asked."""
    tokens = torch.randint(0, VOCAB, (2, 24))
    base = random_model(model_config(**SHAPE))
    before = loss_of(base(tokens), tokens)
    apply_lora(base, LoraConfig(enabled=True, target_modules=TARGETS["all-linear"], init="gaussian"))
    assert torch.equal(loss_of(base(tokens), tokens), before)

    model, lora = lora_model(TARGETS["all-linear"], reset_optimizer_on_merge=True)
    model.double()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    loss_of(model(tokens), tokens).backward()
    optimizer.step()
    with torch.no_grad():
        trained = loss_of(model(tokens), tokens)
        assert merge_adapters(model, lora, seed=3, optimizer=optimizer) == 15
        parity.close(loss_of(model(tokens), tokens), trained, atol=FP64_TOL, what="loss after the merge")
    assert all(not m.lora_B.any() and m.lora_A.any() for m in model.modules() if isinstance(m, LoRALinear))
    assert all(not v.any() for state in optimizer.state.values() for v in state.values())


def run_dir_losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def saved(run_dir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Tensors of the newest checkpoint of `run_dir`, read whole."""
    path = latest_checkpoint(run_dir / "checkpoints")[1]
    meta = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    tensors = {n: torch.empty(meta[f"model.{n}"].size) for n in names}
    read_state(path, {"model": tensors})
    return tensors


def test_training_changes_only_the_adapters_resumes_exactly_and_merges(tmp_path):
    """From a base run's checkpoint: LoRA on all linears trains and leaves every base tensor bitwise
    as loaded, and with save_adapters_only (checkpoints without the base) a stopped run resumes to exactly the
    losses of one run. A merging run's last checkpoint has B = 0 and a base that moved."""
    from engine.train.run_dir import run_config
    from engine.train.trainer import train

    def cfg(*extra: str) -> JobConfig:
        return load_job_config(PRESET, [*TINY, *extra])

    train(cfg("train.max_steps=2"), tmp_path / "base")
    lora = (
        f"checkpoint.load_path={tmp_path / 'base'}",
        "lora.enabled=true",
        'lora.target_modules=["layers.*.attention.*", "layers.*.feed_forward.*"]',
        "lora.save_adapters_only=true",
        "optimizer.lr=1e-2",
        "scheduler.decay_steps=4",
    )
    train(cfg("train.max_steps=6", *lora), tmp_path / "whole")
    whole = run_dir_losses(tmp_path / "whole")
    assert len(whole) == 6
    train(cfg("train.max_steps=3", *lora, "checkpoint.interval=3"), tmp_path / "parts")
    train(run_config(tmp_path / "parts", ["train.max_steps=6"]), tmp_path / "parts")
    assert run_dir_losses(tmp_path / "parts") == whole

    path = latest_checkpoint(tmp_path / "whole" / "checkpoints")[1]
    keys = set(SafeFileSystemReader(path).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.")]
    assert len(model_keys) == 2 * 2 * 7 and all(k.endswith(("lora_A", "lora_B")) for k in model_keys)

    base_names = [f"layers.{i}.{w}.weight" for i in range(2) for w in ("attention.wq", "feed_forward.w2")]
    base = saved(tmp_path / "base", base_names)
    train(cfg("train.max_steps=3", *lora[:3]), tmp_path / "full")  # checkpoints with the base in them
    assert all(torch.equal(t, base[n]) for n, t in saved(tmp_path / "full", base_names).items())
    merging = (*lora[:3], "lora.merge_interval=3", "lora.reset_optimizer_on_merge=true", "optimizer.lr=1e-2")
    train(cfg("train.max_steps=6", *merging), tmp_path / "merging")
    moved = saved(tmp_path / "merging", [*base_names, "layers.0.attention.wq.lora_B"])
    assert not moved.pop("layers.0.attention.wq.lora_B").any()  # merged at step 6, before the checkpoint
    assert not any(torch.equal(t, base[n]) for n, t in moved.items())


def nf4_bytes(weight) -> int:
    """What torchao's NF4Tensor holds: 4-bit codes, 8-bit group scales, their fp32 factors and mean."""
    return sum(
        getattr(weight, part).nbytes
        for part in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")
    )


def test_qlora_nf4_base_is_close_small_and_trains(parity):
    """NF4 base (group 64): logits within 15 % (relative L2) of the fp32 base's and equal (1e-5) to those of
    its dequantized weights held in fp32, 0.5 byte/parameter plus
    ~1.6 % for the scales, and 10 AdamW steps of the adapters on one batch lower its loss."""
    torch.manual_seed(0)
    cfg = model_config(dim=128, n_layers=2, n_heads=4, n_kv_heads=2)
    fp32 = Transformer(cfg)
    nf4 = Transformer(cfg)
    nf4.load_state_dict(fp32.state_dict())
    lora = LoraConfig(enabled=True, target_modules=TARGETS["all-linear"][:2], quantize_base="nf4", group_size=64)
    apply_lora(nf4, lora)
    tokens = torch.randint(0, VOCAB, (4, 32))
    with torch.no_grad():
        reference, quantized = fp32(tokens), nf4(tokens)
    # NF4 rounds each weight by ~9 % (relative L2) here; the logits move by ~11 % (measured 0.107).
    assert ((quantized - reference).norm() / reference.norm()).item() < 0.15
    adapted = [m for m in nf4.modules() if isinstance(m, LoRALinear)]
    dequantized = Transformer(cfg)  # what NF4 stores, held in fp32: the on-the-fly dequantization computes it
    dequantized.load_state_dict(
        {
            n: (t.to(torch.float32) if type(t).__name__ == "NF4Tensor" else t)
            for n, t in nf4.state_dict().items()
            if not n.endswith(("lora_A", "lora_B"))
        }
    )
    with torch.no_grad():
        # the same weights, dequantized on the fly or held in fp32: the matmuls' order may differ (model_bound)
        bound = model_bound(cfg, quantized.abs().max().item())
        parity.close(dequantized(tokens), quantized, atol=bound, what="NF4 against its dequantized weights")
    assert len(adapted) == 2 * 7 and all(type(m.weight).__name__ == "NF4Tensor" for m in adapted)
    numel = sum(m.weight.numel() for m in adapted)
    per_param = sum(nf4_bytes(m.weight) for m in adapted) / numel
    assert 0.5 < per_param < 0.5 + 1 / 64 + 0.002, per_param

    optimizer = torch.optim.AdamW([p for p in nf4.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(10):
        loss = loss_of(nf4(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.slow
def test_fsdp_on_two_processes_equals_one_process(tmp_path, parity):
    """LoRA under FSDP2 on 2 processes (adapters sharded with their block, like every parameter; with
    activation checkpointing) computes the one-process run: same losses and the same trained adapters, and a
    merge at step 2 (engine/train/lora_merge.py: gathered whole, re-sharded) gives the same base weights."""
    from tests.helpers.layouts import forge, records, tolerance

    common = (
        "--lora.enabled=true",
        '--lora.target_modules=["layers.*.attention.*", "layers.*.feed_forward.*"]',
        "--optimizer.lr=1e-2",
        "--train.max_steps=3",
        "--eval.enabled=false",
        "--lora.merge_interval=2",
        "--lora.reset_optimizer_on_merge=true",
    )
    for name, extra in (("one", {}), ("two", {"nproc": 2})):
        args = (*common, "--train.activation_checkpointing=full") if extra else common
        result = forge(tmp_path / name, *args, **extra)
        assert result.returncode == 0, result.stderr[-3000:]
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert sorted(two) == sorted(one) == list(range(1, 4))
    tol = tolerance(tmp_path / "one")  # fp32 runs: tests/helpers/parity.TrainingTolerance
    for step in one:
        parity.within(f"loss step {step}", abs(two[step]["loss"] - one[step]["loss"]), tol.loss_at(step))
    names = [
        f"layers.{i}.{m}.{p}"
        for i in range(4)
        for m in ("attention.wq", "feed_forward.w2")
        for p in ("lora_A", "lora_B", "weight")
    ]
    ours, theirs = saved(tmp_path / "two", names), saved(tmp_path / "one", names)
    assert any(t.any() for n, t in theirs.items() if n.endswith("lora_B"))  # the adapters trained after the merge
    for run in ("one", "two"):  # the merge ran, on every adapter, in both runs
        assert "step 2: merged 28 LoRA adapters into the base weights" in (tmp_path / run / "train.log").read_text()
    largest = max(t.abs().max().item() for t in theirs.values())
    bound = tol.weights([one[step]["lr"] for step in sorted(one)], largest)
    parity.close(ours, theirs, atol=bound, what="adapters and merged base weights")


def test_adapted_blocks_checkpoint_and_compile_to_the_same_gradients(parity):
    """Activation checkpointing and a full-graph compile of adapted blocks (dynamo must trace LoRALinear
    without a graph break; its eager backend keeps this quick, tests/train/test_trainer.py runs inductor): same
    logits and adapter gradients as eager (float64, the same function), and the blocks ran as the graph dynamo
    traced."""
    from engine.parallel.activation_checkpoint import apply_activation_checkpointing

    graphs, calls = [], []

    def counting(graph: torch.fx.GraphModule, example_inputs) -> object:
        """Dynamo's eager backend (run the traced graph as it is), counting graphs and their calls."""
        graphs.append(graph)

        def call(*args):
            calls.append(graph)
            return graph.forward(*args)

        return call

    torch._dynamo.reset()
    model, _ = lora_model(TARGETS["all-linear"])
    model.double()
    tokens = torch.randint(0, VOCAB, (2, 24))

    def logits_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        logits = model(tokens)
        loss_of(logits, tokens).backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

    eager_logits, eager_grads = logits_and_grads()
    apply_activation_checkpointing(model, "full")
    for block in model.layers.values():
        block.compile(fullgraph=True, backend=counting)
    logits, grads = logits_and_grads()
    # Each block's forward ran as a graph dynamo traced: one call per block, at most one graph per block.
    assert len(model.layers) == len(calls) == 2 and 1 <= len(graphs) <= 2, (len(calls), len(graphs))
    parity.close(logits, eager_logits, atol=FP64_TOL, what="logits")
    assert len(grads) == len(eager_grads) == 2 * (2 * 7 + 1)
    parity.close(grads, eager_grads, atol=FP64_TOL, what="adapter gradients")


def test_memory_estimate_counts_a_frozen_base_and_trained_adapters():
    """The estimate of validate-config against the model itself: the adapters add their fp32 weights, and only
    they have gradients and AdamW state; an NF4 base takes ~0.516 byte per weight."""
    from engine.parallel.memory import estimate_memory

    cfg = load_job_config(PRESET, [])
    lora = LoraConfig(enabled=True, target_modules=TARGETS["all-linear"][:2])
    model = Transformer(cfg.model)
    apply_lora(model, lora)
    adapters = [p for p in model.parameters() if p.requires_grad]
    adapter_numel = sum(p.numel() for p in adapters)
    target_numel = sum(m.weight.numel() for m in model.modules() if isinstance(m, LoRALinear))
    plain = estimate_memory(cfg, 1)[0]
    adapted = estimate_memory(cfg.model_copy(update={"lora": lora}), 1)[0]
    assert adapted.params == plain.params + 4 * adapter_numel
    assert adapted.grads == 4 * adapter_numel
    assert adapted.optimizer == 8 * adapter_numel + 4 * len(adapters)  # exp_avg, exp_avg_sq, step
    nf4 = estimate_memory(cfg.model_copy(update={"lora": lora.model_copy(update={"quantize_base": "nf4"})}), 1)[0]
    assert (nf4.params - (adapted.params - 4 * target_numel)) / target_numel == pytest.approx(0.516, abs=0.001)


def test_lora_settings_that_cannot_work_exit_2_and_write_nothing(tmp_path):
    runner = CliRunner()
    refused = runner.invoke(
        app, ["validate-config", str(PRESET), "--lora.quantize_base=nf4", "--lora.enabled=true", "--world-size", "2"]
    )
    assert refused.exit_code == 2
    assert "one process only" in refused.output and "save_adapters_only" in refused.output
    unread = runner.invoke(app, ["validate-config", str(PRESET), "--lora.rank=4"])
    assert unread.exit_code == 2 and "lora.rank" in unread.output and "lora.enabled" in unread.output
    typo = runner.invoke(
        app,
        [
            "train",
            str(PRESET),
            "--run-dir",
            str(tmp_path / "run"),
            *[f"--{o}" for o in TINY],
            "--lora.enabled=true",
            '--lora.target_modules=["layers.*.attn.*"]',
        ],
    )
    assert typo.exit_code == 2 and "lora.target_modules" in typo.output
    assert not (tmp_path / "run").exists()
