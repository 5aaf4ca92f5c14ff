"""The parallelisms are applied in one fixed order; changing it breaks what later stages expect to see."""

from __future__ import annotations

from types import SimpleNamespace

import engine.parallel.apply as apply
from engine.config import load_job_config
from engine.model.transformer import Transformer

ORDER = [
    "tensor_parallel",
    "context_parallel",
    "expert_parallel",
    "float8",
    "activation_checkpointing",
    "compile",
    "fsdp",
]


def test_stages_run_in_the_documented_order(monkeypatch):
    calls: list[str] = []
    for name, attr in [
        ("tensor_parallel", "apply_tensor_parallel"),
        ("context_parallel", "apply_context_parallel"),
        ("expert_parallel", "apply_expert_parallel"),
        ("float8", "convert_to_float8"),
        ("activation_checkpointing", "apply_activation_checkpointing"),
        ("compile", "apply_compile"),
        ("fsdp", "apply_fsdp"),
    ]:
        monkeypatch.setattr(apply, attr, lambda *args, _name=name, **kwargs: calls.append(_name))
    monkeypatch.setattr(apply, "check_compilable", lambda *args: None)
    cfg = load_job_config(
        None,
        [
            "--model.dim=32",
            "--model.n_layers=1",
            "--model.n_heads=2",
            "--model.vocab_size=64",
            "--train.mixed_precision=fp8",
            "--train.activation_checkpointing=full",
            "--train.compile_model=true",
        ],
    )
    submesh = SimpleNamespace(size=lambda: 2)
    mesh = SimpleNamespace(get=lambda name: submesh, fsdp=submesh, expert_fsdp=submesh)  # every dimension present
    apply.parallelize(Transformer(cfg.model), cfg, mesh)
    # FP8 swaps modules, so under TP it comes first: TP's hooks must be on the swapped modules.
    assert calls == [
        "float8",
        "tensor_parallel",
        *(name for name in ORDER if name not in ("float8", "tensor_parallel")),
    ]
    calls.clear()
    no_tp = SimpleNamespace(get=lambda name: None if name == "tp" else submesh, fsdp=submesh, expert_fsdp=submesh)
    apply.parallelize(Transformer(cfg.model), cfg, no_tp)
    assert calls == [name for name in ORDER if name != "tensor_parallel"]


def test_a_single_process_gets_only_what_its_config_asks_for(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(apply, "apply_compile", lambda *args: calls.append("compile"))
    monkeypatch.setattr(apply, "apply_fsdp", lambda *args, **kwargs: calls.append("fsdp"))
    cfg = load_job_config(None, ["--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.vocab_size=64"])
    model = apply.parallelize(Transformer(cfg.model), cfg, None)
    assert calls == [] and isinstance(model, Transformer)
