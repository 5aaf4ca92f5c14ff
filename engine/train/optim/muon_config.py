"""Muon's config (torch-free): its own fields, its state size, and its registration (engine/train/optim/muon.py
builds it)."""

from __future__ import annotations

from pydantic import Field

from engine.config.optimizer import FP32, AdamEps, OptimizerState
from engine.config.registry import OPTIMIZERS


@OPTIMIZERS.register("muon", build="engine.train.optim.muon:muon")
class MuonConfig(AdamEps):
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="muon only: Nesterov momentum of the hidden matrices")
    muon_ns_steps: int = Field(5, ge=1, le=20, description="muon only: Newton–Schulz iterations per orthogonalization")
    muon_adam_lr: float | None = Field(
        None, gt=0, description="muon only: peak lr of the AdamW fallback (embeddings, output head, norms); unset = lr"
    )

    def state(self) -> OptimizerState:
        # A momentum buffer per hidden matrix (engine.train.optim.groups.hidden_matrices), AdamW's exp_avg and
        # exp_avg_sq for the rest (its `step` is a Python int); the orthogonalization holds the whole matrix, its
        # iterate and the result.
        return OptimizerState(2 * FP32, by_kind={"hidden_matrix": FP32}, step_copies={"hidden_matrix": 3})
