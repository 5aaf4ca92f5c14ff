"""The memory options (issue 38) driven by the trainer on CPU: torchao's 8-bit AdamW state
(`optimizer.state_dtype = "int8"`) and activation offload (`train.activation_offload`).

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
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from engine.config import load_job_config
from engine.train.hooks import TrainHooks
from engine.train.optim import param_groups
from engine.train.trainer import train

DEBUG = Path(__file__).parents[1] / "presets" / "debug.toml"
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


class Recorder(TrainHooks):
    """The job, its initial weights, and per step the lr of each param group and the gradients the update
    received (no clipping and fp32: they are exactly what the optimizer steps with); and whether the forward
    ran under save_on_cpu's hooks."""

    def __init__(self) -> None:
        self.job = None
        self.initial: dict[str, torch.Tensor] = {}
        self.lrs: list[list[float]] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.offloaded: list[bool] = []

    def before_step(self, step, job) -> None:
        if self.job is None:
            self.job = job
            self.initial = {n: p.detach().clone() for n, p in job.model.named_parameters()}
            job.model.norm.register_forward_hook(self.forward_hooks)  # the final norm
        self.lrs.append([float(g["lr"]) for g in job.optimizer.param_groups])

    def after_backward(self, step, job) -> None:
        self.grads.append({n: p.grad.clone() for n, p in job.model.named_parameters()})

    def forward_hooks(self, module, args, out) -> None:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.offloaded.append(hooks is not None and hooks[0].__qualname__.startswith("save_on_cpu"))


def run(tmp_path: Path, name: str, *overrides: str) -> tuple[Recorder, list[float]]:
    recorder = Recorder()
    train(load_job_config(DEBUG, [*TINY, *overrides]), tmp_path / name, hooks=recorder)
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return recorder, [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """A state tensor's storage: torchao's 8-bit state is a wrapper of codes, block scales and its table."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    return [getattr(t, name) for name in t.__tensor_flatten__()[0]]


def test_forge_drives_torchao_adamw8bit_exactly(tmp_path, eager_torchao):
    """The trainer's int8 AdamW (param groups, weight decay, schedule) against torchao's AdamW8bit stepped by
    hand with the same gradients and learning rates: the same weights and the same 8-bit state, bit for bit."""
    from torchao.optim import AdamW8bit

    recorder, _ = run(tmp_path, "int8", "optimizer.state_dtype=int8", "train.grad_clip_norm=0")
    job = recorder.job
    assert type(job.optimizer) is AdamW8bit
    reference = type(job.model)(job.model.cfg)
    reference.load_state_dict(recorder.initial)
    o = job.cfg.optimizer
    optimizer = AdamW8bit(param_groups(reference, o.weight_decay), lr=o.lr, betas=o.betas, eps=o.eps)
    params = dict(reference.named_parameters())
    assert len(recorder.grads) == len(recorder.lrs) == 4
    for grads, lrs in zip(recorder.grads, recorder.lrs):
        for name, grad in grads.items():
            params[name].grad = grad
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"].fill_(lr)
        optimizer.step()
    trained = dict(job.model.named_parameters())
    assert all(torch.equal(trained[n], p) for n, p in params.items()), "weights differ"
    quantized = 0
    for name, p in params.items():
        ours, theirs = job.optimizer.state[trained[name]], optimizer.state[p]
        assert sorted(ours) == sorted(theirs) == ["exp_avg", "exp_avg_sq", "step"]
        for key in ours:
            a, b = inner_tensors(ours[key]), inner_tensors(theirs[key])
            assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), (name, key)
            quantized += len(a) == 3
    assert quantized >= 2 * 8  # the 8 block matrices (2 blocks × wq, wk, wv, wo, w1, w2, w3 ≥ 4096 ...) at least


def test_int8_state_trains_close_to_fp32(tmp_path, eager_torchao):
    """Six steps of the toy debug model: 8-bit moments change each update by at most the codes' relative
    resolution, so the loss curve stays within a small fraction of fp32's loss drop. The longer run is
    benchmarks/memory_options.py (results in benchmarks/results/memory_options.md)."""
    steps = ("train.max_steps=6",)
    _, fp32 = run(tmp_path, "fp32", *steps)
    _, int8 = run(tmp_path, "int8", *steps, "optimizer.state_dtype=int8")
    assert len(fp32) == len(int8) == 6
    assert fp32[0] == int8[0]  # the first forward precedes any update
    drop = fp32[0] - fp32[-1]
    assert drop > 0.1
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


@pytest.mark.parametrize(
    "option",
    [("optimizer.state_dtype=int8",), ("train.activation_offload=true", "train.activation_checkpointing=full")],
    ids=["int8", "activation-offload"],
)
def test_each_option_resumes_bitwise(tmp_path, eager_torchao, option):
    """Two steps, a checkpoint, two more from it: the losses and the final weights and optimizer state of four
    steps at once (the 8-bit codes and scales go through DCP as the wrapper's tensors)."""
    from engine.train.run_dir import run_config

    common = (*option, "checkpoint.interval=2")
    whole, whole_losses = run(tmp_path, "whole", *common)
    run(tmp_path, "parts", *common, "train.max_steps=2")
    parts = Recorder()
    train(run_config(tmp_path / "parts", ["train.max_steps=4"]), tmp_path / "parts", hooks=parts)
    lines = (tmp_path / "parts" / "metrics.jsonl").read_text().splitlines()
    assert [r["loss"] for r in map(json.loads, lines) if "loss" in r] == whole_losses
    a, b = dict(whole.job.model.named_parameters()), dict(parts.job.model.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    for name in a:
        sa, sb = whole.job.optimizer.state[a[name]], parts.job.optimizer.state[b[name]]
        assert sorted(sa) == sorted(sb)
        for key in sa:
            x, y = inner_tensors(sa[key]), inner_tensors(sb[key])
            assert len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y)), (name, key)


def test_changing_the_state_dtype_on_resume_is_refused(tmp_path):
    """The moments of one dtype are not those of another: `forge resume` refuses the change (exit 2), naming
    the field; activation offload may change (it changes no value)."""
    from engine.config.changes import resume_issues

    saved = load_job_config(DEBUG, TINY)
    issues = resume_issues(saved, load_job_config(DEBUG, [*TINY, "optimizer.state_dtype=int8"]))
    assert [i.path for i in issues] == ["optimizer.state_dtype"]
    assert resume_issues(saved, load_job_config(DEBUG, [*TINY, "train.activation_offload=true"])) == []
