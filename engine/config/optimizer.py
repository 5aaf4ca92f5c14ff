"""`[optimizer]`: which optimizer and its hyperparameters, and what state an optimizer keeps (`OptimizerState`).

`name`, `lr`, `weight_decay` and `betas` are every optimizer's (`OptimizerFields`); each optimizer's own fields
are declared by its config class beside it (engine/train/optim/NAME_config.py, registered in `OPTIMIZERS`), and
`OptimizerConfig`, the `[optimizer]` table, is composed of them all (engine/config/registry.py:
`ComponentRegistry`). A field set away from its default while another optimizer is chosen is a config error
naming the optimizers that read it (`JobConfig.validate`), so no field is silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from pydantic import Field

from engine.config.base import Section
from engine.config.registry import OPTIMIZERS

Beta = Annotated[float, Field(ge=0, lt=1)]


class OptimizerFields(Section):
    """The fields every optimizer reads; an optimizer's config class derives from it (or from a mixin that does)."""

    name: str = Field("adamw", description="the optimizer (docs/training.md#optimizers)")
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

    def state(self) -> OptimizerState:
        """The memory the optimizer keeps (bytes per parameter element and per tensor), torch-free: what
        `validate-config`, `init` and `slurm submit` estimate memory and checkpoint sizes from."""
        raise NotImplementedError(f"optimizer {self.name!r} does not say what state it keeps")

    def weight_bytes(self) -> int:
        """Bytes per element of the trained weights and of their gradients (fp32 unless the optimizer says)."""
        return FP32


class AdamEps(OptimizerFields):
    """Adam's denominator term, for the optimizers built on Adam's update."""

    eps: float = Field(
        1e-8, gt=0, description="added to Adam's denominator; adamw, muon (fallback), schedule_free_adamw"
    )


class OptimizerConfig(OptimizerFields):
    """The `[optimizer]` table: the shared fields and every registered optimizer's own ones (composed by
    `OPTIMIZERS.bind` below; read the chosen optimizer's own config with `OPTIMIZERS.chosen(cfg)`)."""


@dataclass(frozen=True)
class OptimizerState:
    """The memory an optimizer keeps, as the memory estimate and the checkpoint size count it
    (engine/parallel/memory.py), returned by the optimizer config class's `state()` (torch-free, unlike the builder).

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
BF16 = 2
EIGHT_BIT = Quantized(tensors=2, code_bytes=1, block_size=256, min_elements=4096, table_entries=256)
"""torchao's OptimState8bit: uint8 codes, an fp32 scale per 256 elements and a 256-entry fp32 table each, for
the hidden matrices of ≥ 4096 elements in whole blocks (embedding and head keep unquantized moments)."""


def optimizer_state(cfg: OptimizerConfig) -> OptimizerState:
    """The state the configured optimizer keeps (its config class's `state()`)."""
    return OPTIMIZERS.chosen(cfg).state()


def weight_bytes(cfg: OptimizerConfig) -> int:
    """Bytes per element of the trained weights and of their gradients."""
    return OPTIMIZERS.chosen(cfg).weight_bytes()


import engine.train.optim  # noqa: E402, F401  (registers every optimizer's config: torch-free)

OPTIMIZERS.bind(OptimizerConfig, OptimizerFields, tail=("state_dtype", "weight_dtype"))
