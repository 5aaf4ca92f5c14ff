"""The memory options (issue 38) driven by the trainer on CPU: torchao's 8-bit AdamW state
(`optimizer.state_dtype = "int8"`), activation offload (`train.activation_offload`) and FSDP2's CPU offload
(`distributed.cpu_offload`).

torchao's AdamW8bit compiles its per-parameter step with torch.compile, which on a CPU costs ~4 s per
parameter shape (C++ code generation) and more with a cold cache; these tests run that same step function
eagerly (`eager_torchao`): the Forge-driven optimizer and the reference then run the very same code, and the
compiled path is what benchmarks/memory_options.py trains with.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from engine.config import load_job_config
from engine.plan import check_config
from engine.precision import cast_weights
from engine.train.callbacks import Callback
from engine.train.optim import hidden_matrices, param_groups
from engine.train.trainer import train
from tests.helpers.parity import TrainingTolerance

DEBUG = Path(__file__).parents[2] / "presets" / "debug.toml"
TINY = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "train.seq_len=32",
    "model.max_seq_len=32",
    "train.batch_size=4",
    "train.max_steps=4",
    "train.mixed_precision=fp32",
    "metrics.log_interval=1",
    "eval.enabled=false",
    "scheduler.warmup_steps=1",
    "scheduler.decay_steps=6",
]
"""Tensors of 64 × 64 and larger (4096 elements and up) get 8-bit state; norms keep fp32 state: both kinds run."""


@pytest.fixture
def eager_torchao(monkeypatch):
    """torchao's AdamW8bit calls torch.compile(single_param_adam) at every step: run it eagerly (see above)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)


class Recorder(Callback):
    """The job, its initial weights, and per step the lr of each param group and the gradients the update
    received (no clipping and fp32: they are exactly what the optimizer steps with); and whether the forward
    ran under save_on_cpu's hooks."""

    def __init__(self) -> None:
        self.job = None
        self.initial: dict[str, torch.Tensor] = {}
        self.lrs: list[list[float]] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.offloaded: list[bool] = []
        self.rng: list[torch.Tensor] = []  # the generator's state before each update (stochastic rounding draws)

    def before_step(self, step, loop) -> None:
        if self.job is None:
            self.job = loop.job
            self.initial = {n: p.detach().clone() for n, p in loop.job.model.named_parameters()}
            loop.job.model.norm.register_forward_hook(self.forward_hooks)  # the final norm
        self.lrs.append([float(g["lr"]) for g in loop.job.optimizer.param_groups])

    def before_optimizer_step(self, step, loop) -> None:
        self.grads.append({n: p.grad.clone() for n, p in loop.job.model.named_parameters()})
        self.rng.append(torch.get_rng_state())

    def forward_hooks(self, module, args, out) -> None:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.offloaded.append(hooks is not None and hooks[0].__qualname__.startswith("save_on_cpu"))


def run(tmp_path: Path, name: str, *overrides: str) -> tuple[Recorder, list[float]]:
    recorder = Recorder()
    train(load_job_config(DEBUG, [*TINY, *overrides]), tmp_path / name, callbacks=[recorder])
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return recorder, [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """A state tensor's storage: torchao's 8-bit state is a wrapper of codes, block scales and its table."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    return [getattr(t, name) for name in t.__tensor_flatten__()[0]]


def test_forge_drives_torchao_adamw8bit_exactly_and_resumes_bitwise(tmp_path, eager_torchao):
    """The trainer's int8 AdamW (param groups, weight decay, schedule) against torchao's own optimizers stepped by
    hand with the same gradients and learning rates, AdamW8bit for the blocks' matrices and its AdamW for the rest
    (embedding and head keep fp32 moments: engine/train/optim/adamw8bit.py; torchao runs the same step function
    on the unquantized state of its small tensors): the same weights and the same 8-bit state, bit for bit.
    Then two steps, a checkpoint and two more from it give that run again (the 8-bit codes and scales go
    through DCP as the wrapper's tensors)."""
    from torchao.optim import AdamW8bit, _AdamW

    common = ("optimizer.state_dtype=int8", "train.grad_clip_norm=0", "checkpoint.interval=2")
    recorder, whole_losses = run(tmp_path, "int8", *common)
    job = recorder.job
    assert isinstance(job.optimizer, AdamW8bit)
    reference = type(job.model)(job.model.cfg)
    reference.load_state_dict(recorder.initial)
    o = job.cfg.optimizer
    hidden = {id(p) for p in hidden_matrices(reference)}
    groups = param_groups(reference, o.weight_decay)
    kwargs = {"lr": o.lr, "betas": o.betas, "eps": o.eps}
    eight_bit = AdamW8bit([{**g, "params": [p for p in g["params"] if id(p) in hidden]} for g in groups], **kwargs)
    full = _AdamW([{**g, "params": [p for p in g["params"] if id(p) not in hidden]} for g in groups], **kwargs)
    params = dict(reference.named_parameters())
    assert len(recorder.grads) == len(recorder.lrs) == 4
    for grads, lrs in zip(recorder.grads, recorder.lrs):
        for name, grad in grads.items():
            params[name].grad = grad
        for optimizer in (eight_bit, full):
            for group, lr in zip(optimizer.param_groups, lrs):  # the same two groups: decayed, not decayed
                group["lr"].fill_(lr)
            optimizer.step()
    state = {**eight_bit.state, **full.state}
    assert_same_training(job.model, job.optimizer, reference, Stateful(state))
    quantized = [n for n, p in params.items() if len(inner_tensors(state[p]["exp_avg"])) == 3]
    # per block wq, wo, w1, w2, w3 (≥ 4096 elements); wk, wv (64 × 32), the norms, the embedding and head keep
    # fp32 moments
    assert len(quantized) == 2 * 5 and not any(n.startswith(("tok_embeddings", "output")) for n in quantized)

    resumed = resume_in_two(tmp_path, common)
    assert resumed[1] == whole_losses
    assert_same_training(job.model, job.optimizer, resumed[0].job.model, resumed[0].job.optimizer)


BF16 = ("optimizer.weight_dtype=bf16", "optimizer.state_dtype=bf16", "train.mixed_precision=bf16")


def test_forge_drives_torchao_bf16_adamw_exactly_and_resumes_bitwise(tmp_path, eager_torchao):
    """bf16 weights and moments: the trainer's optimizer against torchao's AdamW (bf16 stochastic rounding)
    stepped by hand with the same gradients, learning rates and random draws: the same weights and state, bit
    for bit; the weights and gradients really are bf16; and a resumed run is the whole one."""
    from torchao.optim import _AdamW

    common = (*BF16, "train.grad_clip_norm=0", "checkpoint.interval=2")
    recorder, whole_losses = run(tmp_path, "bf16", *common)
    job = recorder.job
    assert type(job.optimizer) is _AdamW and job.optimizer.bf16_stochastic_round
    assert {p.dtype for p in job.model.parameters()} == {torch.bfloat16}
    assert {g.dtype for grads in recorder.grads for g in grads.values()} == {torch.bfloat16}
    reference = type(job.model)(job.model.cfg)
    cast_weights(reference, torch.bfloat16)
    reference.load_state_dict(recorder.initial)
    o = job.cfg.optimizer
    optimizer = _AdamW(
        param_groups(reference, o.weight_decay), lr=o.lr, betas=o.betas, eps=o.eps, bf16_stochastic_round=True
    )
    params = dict(reference.named_parameters())
    assert len(recorder.grads) == len(recorder.lrs) == len(recorder.rng) == 4
    for grads, lrs, rng in zip(recorder.grads, recorder.lrs, recorder.rng):
        for name, grad in grads.items():
            params[name].grad = grad
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"].fill_(lr)
        torch.set_rng_state(rng)
        optimizer.step()
    assert_same_training(job.model, job.optimizer, reference, optimizer)

    resumed = resume_in_two(tmp_path, common)
    assert resumed[1] == whole_losses
    assert_same_training(job.model, job.optimizer, resumed[0].job.model, resumed[0].job.optimizer)


class Stateful:
    """Two optimizers' state as one, for `assert_same_training`."""

    def __init__(self, state: dict) -> None:
        self.state = state


def resume_in_two(tmp_path: Path, common: tuple[str, ...]) -> tuple[Recorder, list[float]]:
    """Two steps into a run directory, then `forge resume` semantics to four: the second part's recorder and
    all four losses."""
    from engine.train.run_dir import run_config

    run(tmp_path, "parts", *common, "train.max_steps=2")
    parts = Recorder()
    train(run_config(tmp_path / "parts", ["train.max_steps=4"]), tmp_path / "parts", callbacks=[parts])
    lines = (tmp_path / "parts" / "metrics.jsonl").read_text().splitlines()
    return parts, [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def assert_same_training(model_a, optimizer_a, model_b, optimizer_b) -> None:
    """The same weights and the same optimizer state, tensor for tensor (8-bit state: codes, scales, table)."""
    a, b = dict(model_a.named_parameters()), dict(model_b.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), "weights differ"
    for name in a:
        sa, sb = optimizer_a.state[a[name]], optimizer_b.state[b[name]]
        assert sorted(sa) == sorted(sb) and sa
        for key in sa:
            x, y = inner_tensors(sa[key]), inner_tensors(sb[key])
            assert len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y)), (name, key)


def test_int8_state_trains_close_to_fp32(tmp_path, eager_torchao):
    """Six steps of the toy debug model: 8-bit moments change each update by at most the codes' relative
    resolution, so the loss curve stays within a small fraction of fp32's loss drop. The longer run is
    benchmarks/memory_options.py (results in benchmarks/results/memory_options.md).

    And the moments really are 8-bit: every hidden matrix's two moments are torchao's quantized state (uint8
    codes, one fp32 scale per block; torchao leaves tensors under 4096 elements unquantized), and the curve leaves fp32's by more than fp32 rounding could (the loss
    tolerance of two fp32 runs of these steps, TrainingTolerance): a quantization that quantizes nothing gives
    fp32's curve back, bit for bit."""
    from torchao.optim.subclass_8bit import OptimState8bit

    steps = ("train.max_steps=6",)
    fp32_run, fp32 = run(tmp_path, "fp32", *steps)
    recorder, int8 = run(tmp_path, "int8", *steps, "optimizer.state_dtype=int8")
    assert len(fp32) == len(int8) == 6
    assert fp32[0] == int8[0]  # the first forward precedes any update
    drop = fp32[0] - fp32[-1]
    assert drop > 0.1
    job = recorder.job
    # torchao (as bitsandbytes) quantizes tensors of ≥ 4096 elements: per block wq, wo, w1, w2, w3, not wk, wv
    quantized = [p for p in hidden_matrices(job.model) if p.numel() >= 4096]
    assert len(quantized) == 2 * 5
    for p in quantized:
        for moment in ("exp_avg", "exp_avg_sq"):
            state = job.optimizer.state[p][moment]
            assert isinstance(state, OptimState8bit) and state.codes.dtype == torch.uint8, (tuple(p.shape), moment)
            assert state.codes.numel() == p.numel() and state.scale.dtype == torch.float32
    rounding = TrainingTolerance.of_run(job.cfg)
    fp32_weights = dict(fp32_run.job.model.named_parameters())
    lrs = [max(step) for step in recorder.lrs]
    for name, p in job.model.named_parameters():
        if any(p is q for q in quantized):
            bound = rounding.weights(lrs, largest=p.abs().max().item())
            departure = (p - fp32_weights[name]).abs().max().item()
            assert departure > bound, (name, departure, bound)
    # Dettmers et al.'s dynamic map keeps ≥ 3 significant bits for values within 1/16 of a block's maximum:
    # a relative error ≤ 2^-4 in each moment, so ≤ 2^-4 + 2^-5 in the update m/√v, and to first order in the
    # loss drop it causes.
    margin = (2**-4 + 2**-5) * drop
    assert max(abs(a - b) for a, b in zip(fp32, int8)) <= margin, (fp32, int8)


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_activation_offload_gives_the_same_gradients(tmp_path, checkpointing):
    """save_on_cpu copies every saved tensor to the host and back: the gradients are those of no offload,
    bit for bit, with and without activation checkpointing."""
    common = (f"train.activation_checkpointing={checkpointing}", "train.max_steps=2")
    plain, plain_losses = run(tmp_path, "plain", *common)
    offloaded, offloaded_losses = run(tmp_path, "offload", *common, "train.activation_offload=true")
    assert offloaded.offloaded == [True, True] and plain.offloaded == [False, False]
    assert plain_losses == offloaded_losses
    assert len(plain.grads) == len(offloaded.grads) == 2
    for a, b in zip(plain.grads, offloaded.grads):
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    warnings = [w.path for w in offloaded.job.warnings]
    assert warnings == ["train.activation_offload"]  # on a CPU it only costs a copy: the user is told


def test_activation_offload_resumes_bitwise(tmp_path):
    """With activation checkpointing too: two steps, a checkpoint, two more give the four-step run."""
    common = ("train.activation_offload=true", "train.activation_checkpointing=full", "checkpoint.interval=2")
    whole, whole_losses = run(tmp_path, "whole", *common)
    parts, losses = resume_in_two(tmp_path, common)
    assert losses == whole_losses and len(losses) == 4
    assert_same_training(whole.job.model, whole.job.optimizer, parts.job.model, parts.job.optimizer)


def test_changing_the_state_dtype_on_resume_is_refused(tmp_path):
    """The moments of one dtype are not those of another: `forge resume` refuses the change (exit 2), naming
    the field; activation offload may change (it changes no value)."""
    from engine.config.changes import resume_issues

    saved = load_job_config(DEBUG, TINY)
    issues = resume_issues(saved, load_job_config(DEBUG, [*TINY, "optimizer.state_dtype=int8"]))
    assert [i.path for i in issues] == ["optimizer.state_dtype"]
    assert resume_issues(saved, load_job_config(DEBUG, [*TINY, "train.activation_offload=true"])) == []


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (FSDP2 on one rank: its only shard), a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_same_values(model_a, optimizer_a, model_b, optimizer_b) -> None:
    """The same weights and AdamW state, tensor for tensor, whether FSDP2 wraps either model or not."""
    a, b = dict(model_a.named_parameters()), dict(model_b.named_parameters())
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.equal(local(a[n]), local(b[n])) for n in a), "weights differ"
    for name in a:
        sa, sb = optimizer_a.state[a[name]], optimizer_b.state[b[name]]
        assert sorted(sa) == sorted(sb) == ["exp_avg", "exp_avg_sq", "step"], name
        assert all(torch.equal(local(sa[k]), local(sb[k])) for k in sa), name


def offloaded_by_fsdp(model) -> bool:
    """Whether FSDP2 wraps the model and every one of its units offloads to the host."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    groups = [unit._get_fsdp_state()._fsdp_param_group for unit in units]
    return len(units) == 3 and all(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups)  # 2 blocks, root


def test_cpu_offload_trains_like_no_offload_and_may_change_on_resume(tmp_path):
    """distributed.cpu_offload on one process: FSDP2 on a mesh of one rank with CPUOffloadPolicy, which on a CPU
    moves nothing, so its losses, weights and AdamW state are those of the run without it, bit for bit (in fp32
    FSDP2 casts nothing, and one rank's reduce-scatter is the gradient itself). Its checkpoint (DCP, by name)
    resumes without it and the other way round into the same four steps; `forge resume` lets it change. The
    host column of the estimate equals the parameter, gradient and optimizer-state bytes FSDP2 holds."""
    from engine.config.changes import resume_issues
    from engine.parallel.memory import estimate_memory
    from engine.train.run_dir import run_config

    common = ("checkpoint.interval=2",)
    plain, plain_losses = run(tmp_path, "plain", *common)
    off, off_losses = run(tmp_path, "off", *common, "distributed.cpu_offload=true")
    assert offloaded_by_fsdp(off.job.model) and not offloaded_by_fsdp(plain.job.model)
    assert [w.path for w in off.job.warnings] == ["distributed.cpu_offload"]  # on a CPU it is said out loud
    assert len(plain_losses) == 4 and off_losses == plain_losses
    assert_same_values(plain.job.model, plain.job.optimizer, off.job.model, off.job.optimizer)

    params = dict(off.job.model.named_parameters())
    held = [p.to_local() for p in params.values()] + [g.to_local() for g in off.grads[-1].values()]
    state = [t for s in off.job.optimizer.state.values() for t in s.values()]  # moments and step counts
    held += [t.to_local() if isinstance(t, DTensor) else t for t in state]
    assert len(held) == 5 * len(params) and all(t.device.type == "cpu" for t in held)
    [row] = estimate_memory(off.job.cfg, 1)
    assert (row.params, row.grads, row.optimizer) == (0, 0, 0)
    assert row.host == sum(t.numel() * t.element_size() for t in held)  # unpadded on one rank: exact

    for first, then in (("true", "false"), ("false", "true")):  # two steps one way, two more the other
        name = f"from_{first}"
        run(tmp_path, name, *common, "train.max_steps=2", f"distributed.cpu_offload={first}")
        resumed_cfg = run_config(tmp_path / name, ["train.max_steps=4", f"distributed.cpu_offload={then}"])
        assert resume_issues(load_job_config(DEBUG, [*TINY, *common]), resumed_cfg) == []
        parts = Recorder()
        train(resumed_cfg, tmp_path / name, callbacks=[parts])
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        assert [r["loss"] for r in map(json.loads, lines) if "loss" in r] == plain_losses
        assert offloaded_by_fsdp(parts.job.model) == (then == "true")
        assert_same_values(plain.job.model, plain.job.optimizer, parts.job.model, parts.job.optimizer)


@pytest.mark.parametrize(
    "overrides,field",
    [
        # autograd saves DTensors under tensor parallelism; save_on_cpu's pinned copies on CUDA cannot hold them
        (["--train.activation_offload=true", "--distributed.tp=2"], r"train\.activation_offload: .*tensor parallelism"),
        # cpu_offload is built and tested with AdamW only
        (["--distributed.cpu_offload=true", "--optimizer.name=muon"], r"optimizer\.name: = 'muon' .*cpu_offload"),
    ],
)
def test_offload_options_are_refused_where_untested(overrides, field):
    from engine.errors import ConfigError
    from tests.conftest import REPO

    with pytest.raises(ConfigError, match=field):
        check_config(load_job_config(REPO / "presets" / "debug.toml", [o.removeprefix("--") for o in overrides]), 2)
