"""μP (engine/model/mup.py): the coordinate check of Tensor Programs V, the multipliers against their
definition, export to transformers, bitwise resume, and the config refusals.

The coordinate check trains the same tiny shape at widths 64 … 1024 for a few AdamW steps and fits the
slope of log RMS(activation) against log width for every layer and step: under μP every layer's activations
stay the same size as the model widens (|slope| < 0.1); under sp (Forge's fixed init std) they do not.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from engine.config.model import ModelConfig
from engine.config.optimizer import OptimizerConfig
from engine.model import build_model
from engine.model.mup import mup_plan
from engine.train.losses import cross_entropy
from engine.train.optim import build_optimizer, current_lr

WIDTHS = (64, 128, 256, 512, 1024)
HEAD_DIM = 16
COORD_STEPS = 5
VOCAB, SEQ, BATCH = 64, 16, 2


def coord_config(width: int, parametrization: str) -> ModelConfig:
    """Width grows by heads of a fixed size, the FFN in proportion (2·dim): every hidden dimension scales."""
    mup = {"mup_base_dim": WIDTHS[0]} if parametrization == "mup" else {}
    return ModelConfig(
        dim=width,
        n_layers=2,
        n_heads=width // HEAD_DIM,
        vocab_size=VOCAB,
        ffn_hidden_dim=2 * width,
        max_seq_len=SEQ,
        parametrization=parametrization,
        **mup,
    )


def activation_rms(width: int, parametrization: str) -> dict[str, list[float]]:
    """Module name → RMS of its output on a fixed batch after each of steps 1 … COORD_STEPS of AdamW."""
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
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-3, weight_decay=0.0))
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


def slopes(parametrization: str) -> dict[tuple[str, int], float]:
    """(module, step) → slope of log RMS against log width over WIDTHS."""
    runs = [activation_rms(width, parametrization) for width in WIDTHS]
    x = np.log(WIDTHS)
    out = {}
    for name in runs[0]:
        assert all(len(run[name]) == COORD_STEPS for run in runs), name
        for step in range(COORD_STEPS):
            out[(name, step + 1)] = float(np.polyfit(x, np.log([run[name][step] for run in runs]), 1)[0])
    return out


def test_coordinate_check_flat_under_mup_not_under_sp():
    mup, sp = slopes("mup"), slopes("sp")
    assert len(mup) == len(sp) == 8 * COORD_STEPS  # embeddings, head, 2 × (block, attention, feed-forward)
    worst_mup = max(mup, key=lambda k: abs(mup[k]))
    worst_sp = max(sp, key=lambda k: abs(sp[k]))
    print(f"worst |slope|: mup {worst_mup} {mup[worst_mup]:+.3f}, sp {worst_sp} {sp[worst_sp]:+.3f}")
    assert abs(mup[worst_mup]) < 0.1, mup
    assert abs(sp[worst_sp]) > 0.3, sp  # sp's activations grow (or its logits blow up) with width
