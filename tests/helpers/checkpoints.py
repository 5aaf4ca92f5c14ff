"""A model and optimizer trained a few steps and saved, with a fresh pair to load them into."""

from __future__ import annotations

import torch

from engine.config.model import ModelConfig
from engine.config.optimizer import OptimizerConfig
from engine.model.transformer import Transformer
from engine.train.losses import cross_entropy
from engine.train.optim import build_optimizer

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16)


def trained_pair(seed: int):
    torch.manual_seed(seed)
    model = Transformer(CFG)
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2))
    for _ in range(3):
        tokens = torch.randint(0, 64, (2, 16))
        cross_entropy(model(tokens), tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer
