"""Bad steps: a non-finite loss or gradient norm, or a loss far above the recent ones.

A bad step is skipped (no optimizer update; its batch is not retried). After `max_bad_steps` in a row
the run rolls back to its last complete checkpoint's weights and optimizer state and goes on with the
batches after the offending ones; the step counter, LR schedule and data order keep going, so metrics
stay monotonic and a resumed run still sees each batch at the same step. After `max_rollbacks` the run
stops as diverged. The spike rule follows OLMo-core's skip-step optimizer: a loss more than
`spike_sigma` standard deviations above the mean of the last `spike_window` accepted losses, once at
least half the window is filled.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

from engine.config.train import TrainConfig


class TrainingDiverged(RuntimeError):
    """Too many rollbacks: the run cannot make progress with its current settings."""


class StepGuard:
    def __init__(self, cfg: TrainConfig) -> None:
        self.sigma, self.max_bad, self.max_rollbacks = cfg.spike_sigma, cfg.max_bad_steps, cfg.max_rollbacks
        self.history: deque[float] = deque(maxlen=cfg.spike_window)
        self.consecutive_bad = 0
        self.skipped_steps = 0
        self.rollbacks = 0

    def problem(self, loss: float, grad_norm: float, scaler_handles_overflow: bool = False) -> str | None:
        """Why this step must be skipped, or None. With a GradScaler (fp16) an overflowing gradient is
        routine: the scaler skips that step and lowers its scale itself."""
        if not math.isfinite(loss):
            return f"non-finite loss ({loss})"
        if not math.isfinite(grad_norm) and not scaler_handles_overflow:
            return f"non-finite gradient norm ({grad_norm})"
        if self.sigma and len(self.history) >= max(self.history.maxlen // 2, 2):
            mean, std = statistics.fmean(self.history), statistics.pstdev(self.history)
            if loss > mean + self.sigma * std:
                return f"loss spike ({loss:.4f} > mean {mean:.4f} + {self.sigma:g} × std {std:.4f})"
        return None

    def accept(self, loss: float) -> None:
        self.history.append(loss)
        self.consecutive_bad = 0

    def reject(self) -> bool:
        """Count a skipped step; True when it is time to roll back."""
        self.skipped_steps += 1
        self.consecutive_bad += 1
        return self.consecutive_bad >= self.max_bad

    def rolled_back(self, reason: str, restored_state: dict[str, Any] | None) -> None:
        """Count a rollback for `reason`, or raise TrainingDiverged past `max_rollbacks`. The loss history
        becomes the restored checkpoint's: the losses since then belonged to weights that are gone."""
        if self.rollbacks >= self.max_rollbacks:
            raise TrainingDiverged(
                f"{reason} after {self.rollbacks} rollback(s) (train.max_rollbacks = {self.max_rollbacks}): the "
                f"run is diverging; lower optimizer.lr, tighten train.grad_clip_norm, or inspect the data here"
            )
        self.rollbacks += 1
        self.consecutive_bad = 0
        if restored_state is not None and "guard" in restored_state:
            self.history.clear()
            self.history.extend(restored_state["guard"]["history"])

    def metrics(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped_steps, "rollbacks": self.rollbacks}

    def state_dict(self) -> dict[str, Any]:
        """JSON-able, so an exactly resumed run makes the same skip decisions."""
        return {
            "history": list(self.history),
            "consecutive_bad": self.consecutive_bad,
            "skipped_steps": self.skipped_steps,
            "rollbacks": self.rollbacks,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history.clear()
        self.history.extend(state["history"])
        self.consecutive_bad, self.skipped_steps, self.rollbacks = (
            state["consecutive_bad"],
            state["skipped_steps"],
            state["rollbacks"],
        )
