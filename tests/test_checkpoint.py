"""DCP checkpoints written by training load back into a fresh model and optimizer exactly."""

from __future__ import annotations

import torch

from engine.checkpoint.dcp import complete_checkpoints, latest_checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint
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


def test_round_trip_restores_weights_and_optimizer(tmp_path):
    model, optimizer = trained_pair(0)
    save_checkpoint(tmp_path, 3, model, optimizer, {"step": 3, "tokens_seen": 96})
    fresh, fresh_opt = trained_pair(1)  # different weights and moments
    state = load_checkpoint(tmp_path / "step_3", fresh, fresh_opt)
    assert state == {"step": 3, "tokens_seen": 96}
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    ours, theirs = optimizer.state_dict()["state"], fresh_opt.state_dict()["state"]
    for key in ours:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ours[key][name], theirs[key][name])


def test_incomplete_folders_are_not_checkpoints_and_pruning_keeps_newest(tmp_path):
    model, optimizer = trained_pair(0)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, optimizer, {"step": step})
    (tmp_path / "step_4").mkdir()  # a save killed before it finished
    (tmp_path / "step_4" / ".metadata").write_bytes(b"")
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [1, 2, 3]
    assert latest_checkpoint(tmp_path)[0] == 3 and (tmp_path / "latest").read_text() == "step_3"
    prune_checkpoints(tmp_path, keep_last_n=2)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 3]
    assert not (tmp_path / "step_1").exists() and (tmp_path / "step_4").exists()  # never the one being written
