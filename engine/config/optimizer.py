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
StateDtype = Literal["fp32", "bf16", "int8"]
WeightDtype = Literal["fp32", "bf16"]


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
    state_dtype: StateDtype = Field(
        "fp32",
        description="adamw only: its moments' storage; int8 = torchao's AdamW8bit (block-wise 8-bit moments "
        "of the blocks' matrices, ~2 bytes a parameter instead of 8; embedding and head keep fp32; update in fp32); "
        "bf16 = torchao's AdamW with bf16 moments, only with weight_dtype = bf16 (docs/training.md#memory-options)",
    )
    weight_dtype: WeightDtype = Field(
        "fp32",
        description="adamw only: the trained weights' dtype; bf16 = weights and gradients in bf16, each "
        "update computed in fp32 and stochastically rounded to bf16 (torchao), with state_dtype bf16 or int8",
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
        "state_dtype": "train/optim/adamw.py, parallel/memory.py",
        "weight_dtype": "train/job.py, train/optim/adamw.py, parallel/memory.py",
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
    "state_dtype": ("adamw",),
    "weight_dtype": ("adamw",),
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
    quantized: Quantized | None = None

    def bytes(self, kind: str, elements: int) -> int:
        """State bytes of one parameter of `kind` holding `elements` elements on a rank."""
        if self.quantized is not None and self.quantized.applies(kind, elements):
            return self.quantized.bytes(elements) + self.bytes_per_tensor
        return self.by_kind.get(kind, self.bytes_per_element) * elements + self.bytes_per_tensor


@dataclass(frozen=True)
class Quantized:
    """Block-wise quantized state tensors (torchao's `OptimState8bit`): a tensor of at least `min_elements`
    elements that splits into whole blocks keeps, per state tensor, a code per element (`code_bytes`), an fp32
    scale per `block_size` elements and its own fp32 lookup table of `table_entries` values; smaller tensors,
    and parameters of other kinds than `kinds`, keep the unquantized state."""

    tensors: int
    code_bytes: int
    block_size: int
    min_elements: int
    table_entries: int
    kinds: tuple[str, ...] = ("hidden_matrix",)

    def applies(self, kind: str, elements: int) -> bool:
        """Whether a parameter of `kind` holding `elements` elements on this rank gets quantized state (torchao
        decides on the local tensor's size; Forge quantizes `kinds` only: engine/train/optim/adamw8bit.py)."""
        return kind in self.kinds and elements >= self.min_elements and elements % self.block_size == 0

    def bytes(self, elements: int) -> int:
        per_tensor = self.code_bytes * elements + FP32 * (elements // self.block_size) + FP32 * self.table_entries
        return self.tensors * per_tensor


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

BF16 = 2
EIGHT_BIT = Quantized(tensors=2, code_bytes=1, block_size=256, min_elements=4096, table_entries=256)
"""torchao's OptimState8bit: uint8 codes, an fp32 scale per 256 elements and a 256-entry fp32 table each, for
the hidden matrices of ≥ 4096 elements in whole blocks (embedding and head keep unquantized moments)."""
ADAMW_STATES: dict[tuple[str, str], OptimizerState] = {
    # (weight_dtype, state_dtype) → torchao's AdamW8bit / AdamW: exp_avg and exp_avg_sq, quantized or in the
    # weights' dtype (torchao makes unquantized moments like the parameter), and an fp32 `step` tensor.
    ("fp32", "int8"): OptimizerState(2 * FP32, bytes_per_tensor=FP32, quantized=EIGHT_BIT),
    ("bf16", "int8"): OptimizerState(2 * BF16, bytes_per_tensor=FP32, quantized=EIGHT_BIT),
    ("bf16", "bf16"): OptimizerState(2 * BF16, bytes_per_tensor=FP32),
}
"""AdamW's state by `optimizer.weight_dtype` and `state_dtype`, where it is not the registered fp32 one."""


def optimizer_state(cfg: OptimizerConfig) -> OptimizerState:
    """The state the configured optimizer keeps: its registered one, or AdamW's of other dtypes."""
    if cfg.name == "adamw" and (cfg.weight_dtype, cfg.state_dtype) in ADAMW_STATES:
        return ADAMW_STATES[cfg.weight_dtype, cfg.state_dtype]
    return OPTIMIZER_STATES.get(cfg.name)


def weight_bytes(cfg: OptimizerConfig) -> int:
    """Bytes per element of the trained weights and of their gradients."""
    return BF16 if cfg.weight_dtype == "bf16" else FP32
