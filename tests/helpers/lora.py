"""A trained LoRA run folder, for the tests that export or convert adapters."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.checkpoint.dcp import save_checkpoint
from engine.config import JobConfig, dump_toml
from engine.config.lora import LoraConfig
from engine.model.transformer import Transformer
from tests.helpers.data_fixtures import tokenizer_file


def save_lora_run(root: Path, model: Transformer, lora: LoraConfig) -> Path:
    """A run directory of a LoRA run: config.toml with its [lora] section and a checkpoint."""
    root.mkdir(parents=True)
    (root / "config.toml").write_text(dump_toml(JobConfig(model=model.cfg, lora=lora)))
    tokenizer_file(root)
    trainable = [p for p in model.parameters() if p.requires_grad]
    save_checkpoint(root / "checkpoints", 5, model, torch.optim.AdamW(trainable), {"step": 5})
    return root
