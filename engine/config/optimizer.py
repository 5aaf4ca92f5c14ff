"""`[optimizer]`: which optimizer and its hyperparameters, and what state each optimizer keeps (`OptimizerState`).

`lr`, `weight_decay` and `betas` are shared; the other fields belong to some optimizers only
(`READ_BY`), and setting one away from its default while another optimizer is chosen is a config error
(`JobConfig.validate`), so no field is silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from pydantic import Field

from engine.config.base import Section
from engine.config.registry import OPTIMIZER_STATES

Beta = Annotated[float, Field(ge=0, lt=1)]
OptimizerName = Literal["adamw", "lion", "muon", "schedule_free_adamw"]


class OptimizerConfig(Section):
    name: OptimizerName = Field("adamw", description="the optimizer (docs/training.md#optimizers)")
    lr: float = Field(
        3e-4,
        gt=0,
        description="peak learning rate; muon: of the hidden matrices (its update is "
        "scaled to AdamW's RMS, so AdamW's lr carries over); lion: use 3–10× less than AdamW",
    )
    weight_decay: float = Field(
        0.1,
        ge=0,
        description="decoupled decay on matrices (not norms, biases, embeddings); lion: use 3–10× more than AdamW",
    )
    betas: tuple[Beta, Beta] = Field(
        (0.9, 0.95),
        description="AdamW's moment decay rates, each in [0, 1); also muon's AdamW fallback and "
        "schedule_free_adamw's (β1 > 0, the paper uses (0.9, 0.999)); lion: "
        "(interpolation, momentum) decay, the paper uses (0.9, 0.99)",
    )
    eps: float = Field(
        1e-8, gt=0, description="added to Adam's denominator; adamw, muon (fallback), schedule_free_adamw"
    )
    fused: bool | None = Field(
        None, description="adamw only: fused AdamW kernel; unset = use it where the device supports it"
    )
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="muon only: Nesterov momentum of the hidden matrices")
    muon_ns_steps: int = Field(5, ge=1, le=20, description="muon only: Newton–Schulz iterations per orthogonalization")
    muon_adam_lr: float | None = Field(
        None, gt=0, description="muon only: peak lr of the AdamW fallback (embeddings, output head, norms); unset = lr"
    )
    schedule_free_warmup_steps: int = Field(
        0, ge=0, description="schedule_free_adamw only: its own linear warmup, lr · (k+1)/N for step k < N"
    )

    readers: ClassVar[dict[str, str]] = {
        "name": "train/optim/__init__.py",
        "lr": "train/optim/, train/schedules.py",
        "weight_decay": "train/optim/groups.py",
        "betas": "train/optim/",
        "eps": "train/optim/adamw.py, train/optim/muon.py, train/optim/schedule_free.py",
        "fused": "train/optim/adamw.py",
        "muon_momentum": "train/optim/muon.py",
        "muon_ns_steps": "train/optim/muon.py",
        "muon_adam_lr": "train/optim/muon.py",
        "schedule_free_warmup_steps": "train/optim/schedule_free.py",
    }
    """The engine modules (under engine/) that read each field: the "read by" column of docs/configuration.md."""


ADAM_FAMILY = ("adamw", "muon", "schedule_free_adamw")
READ_BY: dict[str, tuple[str, ...]] = {
    "eps": ADAM_FAMILY,
    "fused": ("adamw",),
    "muon_momentum": ("muon",),
    "muon_ns_steps": ("muon",),
    "muon_adam_lr": ("muon",),
    "schedule_free_warmup_steps": ("schedule_free_adamw",),
}
"""Fields that only some optimizers read, and which ones."""


@dataclass(frozen=True)
class OptimizerState:
    """The memory an optimizer keeps, as the memory estimate and the checkpoint size count it
    (engine/parallel/memory.py), registered by name in OPTIMIZER_STATES (torch-free, unlike the builder).

    - `bytes_per_element`: state bytes per element of a trained parameter (fp32 tensors the shape of it);
    - `by_kind`: the same for parameter kinds that differ (`ParamSpec.kind`, e.g. "hidden_matrix");
    - `bytes_per_tensor`: state per parameter tensor whatever its size (AdamW's scalar `step` tensor);
    - `step_copies`: kind → fp32 copies of the largest whole parameter of that kind held while stepping
      (Muon gathers a matrix and keeps its Newton–Schulz iterate and result).
    """

    bytes_per_element: int
    by_kind: dict[str, int] = field(default_factory=dict)
    bytes_per_tensor: int = 0
    step_copies: dict[str, int] = field(default_factory=dict)

    def bytes(self, kind: str, elements: int) -> int:
        """State bytes of one parameter of `kind` holding `elements` elements on a rank."""
        return self.by_kind.get(kind, self.bytes_per_element) * elements + self.bytes_per_tensor


FP32 = 4
# exp_avg and exp_avg_sq, and the scalar `step` tensor.
OPTIMIZER_STATES.register("adamw")(OptimizerState(2 * FP32, bytes_per_tensor=FP32))
# exp_avg.
OPTIMIZER_STATES.register("lion")(OptimizerState(FP32))
# A momentum buffer per hidden matrix (engine.train.optim.groups.hidden_matrices), AdamW's exp_avg and
# exp_avg_sq for the rest (its `step` is a Python int); the orthogonalization holds the whole matrix, its
# iterate and the result.
OPTIMIZER_STATES.register("muon")(
    OptimizerState(2 * FP32, by_kind={"hidden_matrix": FP32}, step_copies={"hidden_matrix": 3})
)
# z and exp_avg_sq.
OPTIMIZER_STATES.register("schedule_free_adamw")(OptimizerState(2 * FP32))
