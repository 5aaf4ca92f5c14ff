"""Optimizers against references nobody here wrote (lion-pytorch, Facebook Research's schedulefree,
torch.optim.Muon / AdamW) and against their papers' equations written out below; their state through
DCP's get_state_dict / set_state_dict; Muon's full-matrix orthogonalization under FSDP2."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from engine.config.optimizer import OptimizerConfig
from engine.plan import check_config
from engine.train.optim import build_optimizer, eval_mode, hidden_matrices
from engine.train.optim.lion import Lion
from engine.train.optim.muon import Muon, orthogonalize
from engine.train.optim.schedule_free import ScheduleFreeAdamW
from tests.helpers.parity import FP64_TOL, U32, Parity
from tests.helpers.torchrun import torchrun

STEPS = 6
SHAPES = [(16, 16), (24, 8), (8, 40)]  # square, tall, wide


# float64 unless a test says otherwise: the claim is that two implementations compute the same update, so
# they are compared to parity.FP64_TOL (parameters and updates of order 1).
def random_params(seed: int = 0, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype) for shape in SHAPES]


def random_grads(step: int, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=g, dtype=dtype) for shape in SHAPES]


def run(optimizer_of, steps: int = STEPS, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """Parameters after `steps` updates with the same random gradients; `optimizer_of(params)` builds it."""
    params = [torch.nn.Parameter(p) for p in random_params(dtype=dtype)]
    optimizer = optimizer_of(params)
    for step in range(steps):
        for p, grad in zip(params, random_grads(step, dtype)):
            p.grad = grad.clone()
        optimizer.step()
    return [p.detach() for p in params]


def assert_close(parity: Parity, ours: list[torch.Tensor], reference: list[torch.Tensor], what: str = "params") -> None:
    assert len(ours) == len(reference) == len(SHAPES)
    parity.close(ours, reference, atol=FP64_TOL, what=what)


def groups(params: list[torch.Tensor], weight_decay: float) -> list[dict]:
    """A decayed group and a non-decayed one, as the model's param groups are."""
    return [{"params": params[:2], "weight_decay": weight_decay}, {"params": params[2:], "weight_decay": 0.0}]


# --- Lion -------------------------------------------------------------------------------------------


def test_lion_matches_lion_pytorch(parity):
    from lion_pytorch import Lion as ReferenceLion

    kwargs = {"lr": 3e-3, "betas": (0.9, 0.99)}
    ours = run(lambda ps: Lion(groups(ps, 0.5), **kwargs))
    reference = run(lambda ps: ReferenceLion(groups(ps, 0.5), **kwargs))
    assert_close(parity, ours, reference)


def test_lion_matches_the_paper(parity):
    """Chen et al. 2023, Algorithm 2: c = β1 m + (1-β1) g; θ -= lr (sign(c) + λ θ); m = β2 m + (1-β2) g."""
    lr, (b1, b2), wd = 3e-3, (0.8, 0.95), 0.3
    theta = random_params()
    m = [torch.zeros_like(t) for t in theta]
    for step in range(STEPS):
        for i, g in enumerate(random_grads(step)):
            c = b1 * m[i] + (1 - b1) * g
            theta[i] = theta[i] - lr * (torch.sign(c) + wd * theta[i])
            m[i] = b2 * m[i] + (1 - b2) * g
    assert_close(parity, run(lambda ps: Lion(ps, lr=lr, betas=(b1, b2), weight_decay=wd)), theta)


# --- Muon -------------------------------------------------------------------------------------------


def newton_schulz_reference(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Jordan et al. 2024: X = G/‖G‖_F (on the wide side); X ← aX + (bA + cA²)X with A = XXᵀ."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def test_muon_matches_its_equations(parity):
    """Nesterov momentum, Newton–Schulz, update scaled by 0.2·sqrt(max(rows, cols)), decoupled decay."""
    lr, mu, wd, ns = 0.02, 0.9, 0.1, 5
    theta = random_params()
    buffers = [torch.zeros_like(t) for t in theta]
    for step in range(STEPS):
        for i, g in enumerate(random_grads(step)):
            buffers[i] = mu * buffers[i] + (1 - mu) * g
            o = newton_schulz_reference(mu * buffers[i] + (1 - mu) * g, ns)
            theta[i] = theta[i] * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(g.shape)) * o
    ours = run(lambda ps: Muon(ps, lr=lr, momentum=mu, weight_decay=wd, ns_steps=ns))
    assert_close(parity, ours, theta)


def test_muon_matches_torch_muon_in_bfloat16(parity):
    """torch.optim.Muon runs Newton–Schulz in bf16 (as the original); ours does too when asked (and on CUDA).
    fp32 parameters, as torch's Muon keeps them: both run the same bf16 Newton–Schulz on the same momentum,
    and differ in the fp32 elementwise ops around it (decay, momentum, the scaled update: ≤ 4 roundings of
    the parameter's size per step), so within STEPS · 4 · 2 · U32 · max|θ|."""
    kwargs = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1, "ns_steps": 5}
    ours = run(lambda ps: Muon(ps, ns_dtype=torch.bfloat16, **kwargs), dtype=torch.float32)
    reference = run(lambda ps: torch.optim.Muon(ps, adjust_lr_fn="match_rms_adamw", **kwargs), dtype=torch.float32)
    largest = max(t.abs().max().item() for t in reference)
    parity.close(ours, reference, atol=STEPS * 4 * 2 * U32 * largest, what="params")


def test_orthogonalize_gives_singular_values_near_one():
    g = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    singular = torch.linalg.svdvals(orthogonalize(g, steps=5))
    assert singular.min() > 0.6 and singular.max() < 1.25  # near 1, not onto it: the quintic trades that for speed


def tiny_model(**overrides) -> torch.nn.Module:
    from engine.config.model import ModelConfig
    from engine.model.transformer import Transformer

    torch.manual_seed(0)
    return Transformer(ModelConfig(dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=8, **overrides))


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = tiny_model()
    optimizer = build_optimizer(model, OptimizerConfig(name="muon", lr=0.02, muon_adam_lr=1e-3))
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g["use_muon"] for p in g["params"]}
    assert muon == {
        f"layers.{i}.{m}.weight"
        for i in range(2)
        for m in (
            "attention.wq",
            "attention.wk",
            "attention.wv",
            "attention.wo",
            "feed_forward.w1",
            "feed_forward.w2",
            "feed_forward.w3",
        )
    }
    fallback = [g for g in optimizer.param_groups if not g["use_muon"]]
    assert {g["lr"] for g in fallback} == {1e-3}
    decayed = {names[id(p)] for g in fallback if g["weight_decay"] for p in g["params"]}
    assert decayed == {"output.weight"}  # embeddings and norms are not decayed
    assert len(hidden_matrices(tiny_model(tie_embeddings=True))) == 14


def test_muon_fallback_is_adamw(parity):
    """The non-matrix groups step exactly as torch.optim.AdamW with the same groups and lr."""
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
    ours = run(lambda ps: Muon([{**g, "use_muon": False} for g in groups(ps, 0.1)], **kwargs))
    reference = run(lambda ps: torch.optim.AdamW(groups(ps, 0.1), foreach=False, **kwargs))
    assert_close(parity, ours, reference)


def test_muon_rejects_non_matrices():
    with pytest.raises(ValueError, match="2-D"):
        Muon([torch.nn.Parameter(torch.zeros(4))])


FSDP_SCRIPT = """
import sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
sys.path.insert(0, {repo!r})
from engine.config.model import ModelConfig
from engine.config.optimizer import OptimizerConfig
from engine.model.transformer import Transformer
from engine.train.optim import build_optimizer

def model_and_data():
    torch.manual_seed(0)
    # dims not divisible by the world size: FSDP pads the uneven shards
    model = Transformer(ModelConfig(dim=36, n_layers=2, n_heads=2, vocab_size=67, max_seq_len=8, ffn_hidden_dim=50))
    tokens = torch.randint(0, 67, (4, 8), generator=torch.Generator().manual_seed(1))
    return model, tokens

def train(model, tokens, name):
    optimizer = build_optimizer(model, OptimizerConfig(name=name, lr=0.02, weight_decay=0.1))
    for _ in range(5):
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer

dist.init_process_group("gloo")
torch.set_default_dtype(torch.float64)  # one function, two layouts: compared in float64
results = {{}}
for name in ("muon", "adamw", "lion", "schedule_free_adamw"):
    model, tokens = model_and_data()
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    train(model, tokens, name)  # every rank sees the same batch: the averaged gradient is the full one
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())
    sharded = {{n: p.full_tensor() for n, p in model.named_parameters()}}
    single, _ = model_and_data()
    train(single, tokens, name)
    results[name] = {{"sharded": sharded, "single": dict(single.named_parameters())}}
if dist.get_rank() == 0:
    torch.save(results, sys.argv[1])
dist.barrier()
dist.destroy_process_group()
from engine.parallel.launch import end_process
end_process(0)  # leave without interpreter teardown while gloo's threads live (see end_process)
"""


def test_fsdp2_equals_single_process(tmp_path, parity):
    """Muon (which must orthogonalize the full matrix, not each rank's shard) and the other optimizers on
    DTensor parameters sharded over 2 CPU ranks: after 5 steps, the same parameters as on one process
    (float64, parity.FP64_TOL)."""
    from tests.helpers.torchrun import REPO

    script = tmp_path / "optimizers_fsdp.py"
    script.write_text(FSDP_SCRIPT.format(repo=str(REPO)))
    out = tmp_path / "params.pt"
    result = torchrun(script, 2, str(out))
    assert result.returncode == 0, result.stdout[-4000:]
    results = torch.load(out)
    assert sorted(results) == sorted(["muon", "adamw", "lion", "schedule_free_adamw"])
    for optimizer, params in results.items():
        assert len(params["sharded"]) == len(params["single"]) > 0
        single = {name: p.detach() for name, p in params["single"].items()}
        parity.close(params["sharded"], single, atol=FP64_TOL, what=optimizer)


# --- Schedule-free AdamW ---------------------------------------------------------------------------


def test_schedule_free_matches_facebookresearch(parity):
    from schedulefree import AdamWScheduleFree

    kwargs = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "warmup_steps": 3}

    def reference(ps):
        optimizer = AdamWScheduleFree(groups(ps, 0.2), foreach=False, **kwargs)
        optimizer.train()
        return optimizer

    ours_opt, ref_opt = [], []
    ours = run(lambda ps: ours_opt.append(ScheduleFreeAdamW(groups(ps, 0.2), **kwargs)) or ours_opt[0])
    ref = run(lambda ps: ref_opt.append(reference(ps)) or ref_opt[0])
    assert_close(parity, ours, ref, "y, the training point")
    ours_opt[0].eval()
    ref_opt[0].eval()
    assert_close(parity, ours, ref, "x, the evaluation point")
    assert [g["k"] for g in ours_opt[0].param_groups] == [STEPS, STEPS]


def test_eval_mode_switches_schedule_free_and_nothing_else(parity):
    ps = [torch.nn.Parameter(p) for p in random_params()]
    optimizer = ScheduleFreeAdamW(ps, lr=1e-2)
    for step in range(3):
        for p, g in zip(ps, random_grads(step)):
            p.grad = g
        optimizer.step()
    y = [p.detach().clone() for p in ps]
    with eval_mode(optimizer):
        x = [p.detach().clone() for p in ps]
        assert not torch.equal(x[0], y[0])
        with pytest.raises(RuntimeError, match="eval mode"):
            optimizer.step()
    assert all(torch.equal(p, yi) for p, yi in zip(ps, y)), "leaving eval mode restores y bit for bit"
    for p, yi, xi in zip(ps, y, x):  # y = β1·x + (1 − β1)·z
        parity.close(yi, 0.9 * xi + 0.1 * optimizer.state[p]["z"], atol=FP64_TOL, what="y = β1·x + (1 − β1)·z")

    lion = Lion(ps)
    before = [p.detach().clone() for p in ps]
    with eval_mode(lion):
        assert all(torch.equal(a, b) for a, b in zip(before, ps))


# --- every optimizer's state through DCP -----------------------------------------------------------

ALL = ["adamw", "lion", "muon", "schedule_free_adamw"]


def step_model(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", ALL)
def test_state_round_trips_through_distributed_checkpoint(tmp_path: Path, name: str):
    """Saved after 3 steps (as the trainer saves: training weights and optimizer state), loaded into fresh
    objects: the next steps are bitwise those of the uninterrupted optimizer."""
    cfg = OptimizerConfig(name=name, lr=1e-2)
    model = tiny_model()
    optimizer = build_optimizer(model, cfg)
    for seed in range(3):
        step_model(model, optimizer, seed)
    before = [p.detach().clone() for p in model.parameters()]
    with eval_mode(optimizer):  # an evaluation before the save leaves the training weights bit for bit
        pass
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp_path, no_dist=True)

    fresh = tiny_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)  # nothing of it may survive the load
    fresh_optimizer = build_optimizer(fresh, cfg)
    model_sd, optim_sd = get_state_dict(fresh, fresh_optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
    set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    for seed in range(3, 6):
        step_model(model, optimizer, seed)
        step_model(fresh, fresh_optimizer, seed)
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n
    assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in fresh_optimizer.param_groups
    ]


# --- every optimizer × every schedule through the trainer ------------------------------------------

# Warmup 2 and a decay that ends on step 10. decay_steps is given even where nothing decays: the run
# directory pins its resolved value, which must not differ between the 5-step and the 10-step call.
SCHEDULES = {
    "cosine": ["scheduler.warmup_steps=2", "scheduler.decay_steps=7"],
    "linear": ["scheduler.warmup_steps=2", "scheduler.decay_steps=7"],
    "rex": ["scheduler.warmup_steps=2", "scheduler.decay_steps=7", "scheduler.rex_alpha=1.5"],
    "wsd": [
        "scheduler.warmup_steps=2",
        "scheduler.stable_steps=3",
        "scheduler.decay_steps=4",
        "scheduler.wsd_decay_type=sqrt",
    ],
    "constant": ["scheduler.warmup_steps=2", "scheduler.decay_steps=7"],
    "none": ["scheduler.decay_steps=9"],
}
OPTIMIZERS = {
    "adamw": ["optimizer.lr=1e-2"],
    "lion": ["optimizer.lr=3e-3", "optimizer.betas=[0.9,0.99]", "optimizer.weight_decay=0.3"],
    "muon": [
        "optimizer.lr=1e-2",
        "optimizer.muon_adam_lr=5e-3",
        "train.loss_fn=chunked_cross_entropy",
        "train.ce_chunk_size=24",
        "train.z_loss_weight=1e-3",
    ],
    "schedule_free_adamw": [
        "optimizer.lr=1e-2",
        "optimizer.schedule_free_warmup_steps=2",
        "optimizer.betas=[0.9,0.999]",
    ],
}
TINY = [
    "model.dim=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=2",
    "metrics.log_interval=1",
    "checkpoint.interval=5",
    "eval.enabled=true",
    "eval.interval=5",
    "eval.steps=1",
    "train.grad_clip_norm=1.0",
]
COMBINATIONS = [
    (o, s) for o in OPTIMIZERS for s in SCHEDULES if o != "schedule_free_adamw" or s in ("constant", "none")
]


@pytest.fixture
def one_thread():
    """The model is tiny: one intra-op thread is faster, and far faster on a CPU shared with other work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from tests.helpers.data_fixtures import tokenized

    root = tmp_path_factory.mktemp("data")
    tokenized(root, name="train")
    tokenized(root, name="eval")
    return root


def train_losses(dataset: Path, run_dir: Path, optimizer: str, schedule: str, max_steps: int) -> dict[int, float]:
    import json

    from engine.train.trainer import train
    from tests.helpers.data_fixtures import job_config

    cfg = job_config(
        dataset / "train",
        *TINY,
        f"eval.dataset_path={dataset / 'eval'}",
        f"train.max_steps={max_steps}",
        f"optimizer.name={optimizer}",
        *OPTIMIZERS[optimizer],
        f"scheduler.name={schedule}",
        *SCHEDULES[schedule],
    )
    train(cfg, run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.parametrize("optimizer,schedule", COMBINATIONS)
def test_trains_and_resumes_exactly(tmp_path, dataset, one_thread, optimizer, schedule):
    whole = train_losses(dataset, tmp_path / "whole", optimizer, schedule, 10)
    first, last = sum(whole[s] for s in (1, 2, 3)) / 3, sum(whole[s] for s in (8, 9, 10)) / 3
    assert last < first - 0.05, whole
    train_losses(dataset, tmp_path / "split", optimizer, schedule, 5)
    resumed = train_losses(dataset, tmp_path / "split", optimizer, schedule, 10)
    assert [resumed[s] for s in range(6, 11)] == [whole[s] for s in range(6, 11)]  # bitwise


# --- configuration ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["--optimizer.name=schedule_free_adamw"], "scheduler.name"),  # with the default cosine schedule
        (
            ["--optimizer.name=schedule_free_adamw", "--scheduler.name=none", "--optimizer.betas=[0,0.99]"],
            "optimizer.betas",
        ),
        (["--optimizer.muon_ns_steps=3"], "optimizer.muon_ns_steps"),  # a Muon field while AdamW is chosen
        (["--optimizer.name=lion", "--optimizer.eps=1e-6"], "optimizer.eps"),
        (["--optimizer.name=muon", "--optimizer.fused=true"], "optimizer.fused"),
        (["--optimizer.schedule_free_warmup_steps=10"], "optimizer.schedule_free_warmup_steps"),
        (["--scheduler.stable_steps=10"], "scheduler.stable_steps"),
        (["--scheduler.name=constant", "--scheduler.min_lr_ratio=0"], "scheduler.min_lr_ratio"),
        (["--scheduler.name=wsd", "--scheduler.rex_alpha=2"], "scheduler.rex_alpha"),
        (["--scheduler.name=wsd", "--scheduler.stable_steps=10"], "scheduler.decay_steps"),
        (["--train.ce_chunk_size=64"], "train.ce_chunk_size"),
    ],
)
def test_fields_the_choice_does_not_read_are_errors(overrides, field):
    from engine.config import load_job_config
    from engine.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        check_config(load_job_config(None, overrides), 1)
    assert [i.path for i in info.value.issues] == [field]


def test_valid_combinations_pass():
    from engine.config import load_job_config

    for overrides in (
        ["--optimizer.name=muon", "--optimizer.muon_ns_steps=3", "--optimizer.muon_adam_lr=1e-3"],
        [
            "--optimizer.name=schedule_free_adamw",
            "--scheduler.name=constant",
            "--scheduler.warmup_steps=5",
            "--optimizer.schedule_free_warmup_steps=10",
        ],
        [
            "--scheduler.name=wsd",
            "--scheduler.stable_steps=10",
            "--scheduler.decay_steps=20",
            "--scheduler.wsd_decay_type=linear",
            "--train.max_steps=100",
        ],
        ["--train.loss_fn=chunked_cross_entropy", "--train.ce_chunk_size=64", "--train.z_loss_weight=1e-4"],
        ["--scheduler.name=none", "--scheduler.decay_steps=99"],
    ):  # pinned by every run directory
        check_config(load_job_config(None, overrides), 1)


def forge_cli(*args: str):
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "forgecli.app", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_bad_combinations_exit_2_with_the_field():
    cases = [
        (["--optimizer.name=schedule_free_adamw", "--scheduler.name=cosine"], "scheduler.name"),
        (["--optimizer.name=muon", "--optimizer.muon_nesterov=true"], "optimizer.muon_nesterov"),
        (["--optimizer.lr=-1"], "optimizer.lr"),
    ]
    for overrides, field in cases:
        result = forge_cli("validate-config", "presets/debug.toml", *overrides)
        assert result.returncode == 2, result.stderr
        assert field in result.stderr and "Traceback" not in result.stderr


def test_validate_config_draws_the_lr_curve():
    result = forge_cli(
        "validate-config",
        "presets/debug.toml",
        "--scheduler.name=wsd",
        "--scheduler.stable_steps=100",
        "--scheduler.decay_steps=100",
        "--scheduler.min_lr_ratio=0",
    )
    assert result.returncode == 0, result.stderr
    assert "Learning rate (wsd schedule, adamw)" in result.stdout and "█" in result.stdout and "▁" in result.stdout
    lines = {
        line.split("│")[1].strip(): line.split("│")[2].strip()
        for line in result.stdout.splitlines()
        if line.count("│") == 3 and line.split("│")[1].strip().isdigit()
    }
    # warmup 20 (preset): step 1 = lr/21, peak from step 21, decay from step 121 to 0 at step 221
    assert lines == {
        "1": "9.524e-05",
        "20": "1.905e-03",
        "21": "2.000e-03",
        "121": "2.000e-03",
        "221": "0.000e+00",
        "300": "0.000e+00",
    }


def test_reported_lr_includes_schedule_free_warmup():
    from engine.train.optim import current_lr

    ps = [torch.nn.Parameter(p) for p in random_params()]
    optimizer = ScheduleFreeAdamW(ps, lr=0.01, warmup_steps=4)
    seen = []
    for step in range(6):
        seen.append(current_lr(optimizer))
        for p, g in zip(ps, random_grads(step)):
            p.grad = g
        optimizer.step()
    assert seen == pytest.approx([0.0025, 0.005, 0.0075, 0.01, 0.01, 0.01])
    assert current_lr(Lion(ps, lr=0.003)) == 0.003
