"""How a model family grows: the shape of each member, from the preset a study starts at. Torch-free.

The rule, read off Forge's dense presets (125m … 70b):
  - width moves in whole attention heads of the preset's own head size (dim = n_heads × head_dim), and a
    GQA preset keeps its ratio of query to key/value heads, so n_heads moves in steps of that ratio;
  - depth follows width as a power law anchored at the preset: n_layers = round(L₀ · (dim / dim₀)^p), with
    p = DEPTH_EXPONENT, the least-squares slope of log n_layers on log dim over those presets
    (tests/scale/test_scale.py derives it again from presets/*.toml);
  - everything else (vocabulary, norms, activation, RoPE, sequence length, FFN multiplier) stays the preset's;
    an explicit ffn_hidden_dim scales with dim.
The presets also widen the head from 64 to 128 above ~1.5B parameters; a study keeps its preset's head size,
since its sizes span one or two decades, not the whole range.

The one function other code calls is `member` (with `members` enumerating them): when model families
become registered specs, the rule moves into the spec and these stay its callers' interface.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from engine.config.model import ModelConfig
from engine.errors import UserError
from engine.model.estimate import param_counts, training_flops_per_token

DEPTH_EXPONENT = 0.58
# The smallest sensible member: two blocks (one block composes nothing across layers) and two heads.
MIN_LAYERS = 2
MIN_HEADS = 2
# The fields the rule sets; the rest of [model] is what makes two runs the same family (`family_fields`).
SCALED_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim")
MAX_HEADS = 4096  # a search bound far above any real model (dim 262,144 at head size 64)


@dataclass(frozen=True)
class Member:
    """One size of the family: its [model] and what Forge counts for it."""

    model: ModelConfig
    params: int  # N: every parameter, embeddings included (what validate-config shows as total)
    flops_per_token: int  # Forge's training FLOPs per token at the study's sequence length, attention included

    @property
    def shape(self) -> str:
        m = self.model
        return f"dim {m.dim}, {m.n_layers} layers, {m.n_heads}/{m.kv_heads} heads"


def check_scalable(base: ModelConfig) -> None:
    """The rule is derived for dense decoder models; an MoE family grows by experts as well, which no preset
    shows yet."""
    if base.num_experts:
        raise UserError(
            f"model.num_experts = {base.num_experts}: scaling plans are for dense families",
            "start the study from a dense preset (model.num_experts = 0)",
        )
    if base.dim % base.n_heads:
        raise UserError(f"model.dim {base.dim} is not a multiple of model.n_heads {base.n_heads}", "fix the preset")


def head_step(base: ModelConfig) -> int:
    """Query heads move in steps of the GQA group (query heads per key/value head)."""
    return base.n_heads // base.kv_heads


def member(base: ModelConfig, n_heads: int, seq_len: int) -> Member:
    """The member with `n_heads` query heads (a multiple of `head_step(base)`)."""
    step = head_step(base)
    if n_heads % step:
        raise ValueError(f"n_heads {n_heads} is not a multiple of the GQA group {step}")
    dim = n_heads * base.head_dim
    n_layers = max(1, round(base.n_layers * (dim / base.dim) ** DEPTH_EXPONENT))
    update: dict[str, int | None] = {
        "dim": dim,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_heads // step if base.n_kv_heads is not None else None,
    }
    if base.ffn_hidden_dim is not None:
        update["ffn_hidden_dim"] = max(1, round(base.ffn_hidden_dim * dim / base.dim))
    model = base.model_copy(update=update)
    return Member(model, param_counts(model)["total"], training_flops_per_token(model, seq_len))


def sensible(m: Member) -> bool:
    return m.model.n_layers >= MIN_LAYERS and m.model.n_heads >= MIN_HEADS


def members(base: ModelConfig, seq_len: int) -> Iterator[Member]:
    """The sensible members by size, smallest first (endless up to MAX_HEADS: the caller stops)."""
    check_scalable(base)
    step = head_step(base)
    for n_heads in range(step, MAX_HEADS + 1, step):
        found = member(base, n_heads, seq_len)
        if sensible(found):
            yield found


def family_fields(model: dict) -> dict:
    """The [model] fields that define the family (all but the ones the rule scales), from a saved config."""
    return {key: value for key, value in model.items() if key not in SCALED_FIELDS}
