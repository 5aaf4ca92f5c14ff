"""What a real model holds, for the memory-estimate comparisons: the bytes autograd saves for a block, weight copies, the tolerance."""

from __future__ import annotations

import torch

from engine.config.job import JobConfig
from engine.model import build_model
from engine.parallel.apply import parallelize
from engine.precision import cast_weights
from engine.train.losses import build_loss

TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128, "max_seq_len": 32}


ACTIVATION_TOLERANCE = 0.05


def job(model: dict | None = None, **sections: dict) -> JobConfig:
    train = {"batch_size": 2, "seq_len": 32, "mixed_precision": "fp32", **sections.pop("train", {})}
    return JobConfig(model={**TINY, **(model or {})}, train=train, **sections)


def saved_activation_bytes(cfg: JobConfig) -> int:
    """Bytes of the distinct tensors autograd saves in one forward + loss, as the saved-tensor hooks see
    them: parameters and buffers, and autocast's low-precision copies of weights, are not activations."""
    torch.manual_seed(0)
    model = build_model(cfg.model)
    if cfg.optimizer.weight_dtype == "bf16":
        cast_weights(model, torch.bfloat16)
    model = parallelize(model, cfg)  # activation checkpointing as the trainer applies it
    state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in state and not is_weight_copy(t):
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len))
    bf16 = cfg.train.mixed_precision == "bf16"
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", torch.bfloat16, enabled=bf16),
    ):
        build_loss(cfg.train)(model, tokens, tokens.clone())
    return sum(seen.values())


def is_weight_copy(t: torch.Tensor) -> bool:
    fn = t.grad_fn
    while fn is not None and fn.name() in ("TBackward0", "ViewBackward0", "TransposeBackward0", "UnsafeViewBackward0"):
        fn = fn.next_functions[0][0]
    return fn is not None and fn.name() == "ToCopyBackward0" and "AccumulateGrad" in fn.next_functions[0][0].name()
