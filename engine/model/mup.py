"""μP, the maximal update parametrization (Yang et al. 2022, "Tensor Programs V"), for Adam-type optimizers.

Under the standard parametrization (sp) the best learning rate and init shift as the model gets wider: a
hidden matrix's update moves its output by Θ(fan_in · lr) (an Adam update's entries are all about lr, and a
wider input sums more of them), and the logits grow with the width of what the head reads. μP rescales
three things with the width multiplier of each tensor, measured against a *base* model (the same config
with `dim = model.mup_base_dim`, where the hyper-parameters were tuned), so that every layer's activations
and their change per step stay the same size as the model widens:

- hidden matrices (the 2-D weights inside the blocks): init std × sqrt(base_fan_in / fan_in) and learning
  rate × base_fan_in / fan_in (their input's width over the base's: dim for the attention projections and
  w1/w3, the FFN width for w2);
- the output logits × mup_base_dim / dim, and an untied head initialised to zero (it keeps its learning
  rate: TP V's equivalent "readout multiplier" form of the output layer, which leaves a tied
  embedding/head pair valid). The zero head is TP V's advice (its appendix on zero-initialising the
  output layer): in the limit the logits at init vanish anyway, and a random head's init term, shrinking
  like 1/sqrt(width), would otherwise make the first steps' logits width-dependent. A tied head keeps the
  embedding's init;
- attention logits q·k / head_dim instead of q·k / sqrt(head_dim) (keys and queries become correlated
  during training, so their dot product grows like head_dim, not its square root).

Embeddings, norms and biases keep init and learning rate: they have one width-sized dimension, and Adam's
Θ(lr) update is already Θ(1) per coordinate. LoRA adapters (width × rank) are such tensors too.
At width multiplier 1 every factor but the attention scale is 1.

The rules for AdamW carry over unchanged to Lion (every coordinate moves by exactly lr, the entrywise update
TP V's Adam analysis assumes) and to schedule-free AdamW (Adam's preconditioner; its averaging weights are
ratios of one group's learning rates, which a constant multiplier leaves alone).

Muon's update of a hidden matrix is not entrywise: it is lr · 0.2·sqrt(max(fan_out, fan_in)) · O with O
semi-orthogonal (every singular value near 1, whatever the gradient's rank), so its spectral norm is
lr · 0.2·sqrt(max(fan_out, fan_in)). The spectral condition for feature learning (Yang, Simon & Bernstein
2023, "A Spectral Condition for Feature Learning") asks ‖ΔW‖ = Θ(sqrt(fan_out / fan_in)). μP widens every
hidden dimension together (`base_config`: the FFN in proportion), so fan_out / fan_in stays fixed and
max(fan_out, fan_in) grows like the fan-in: Muon's hidden-matrix lr takes sqrt(base_fan_in / fan_in)
(`ParamScale.muon_lr`), the square root of Adam's factor, which keeps ‖ΔW‖ at the base width's. Its init
and everything Muon leaves to its AdamW fallback (embeddings, head, norms, biases) follow the rules above.

Everything here is torch-free arithmetic on the family's `param_specs` (validate-config shows the plan);
the model applies the init and the two logit scales (engine/model/transformer.py, attention.py), the
optimizer's param groups the learning rates (engine/train/optim/groups.py), and `forge convert` folds the
logit scales into the weights (engine/checkpoint/hf_mapping.py reads `export_scales`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from engine.config.model import ModelConfig
from engine.model.spec import spec_for


@dataclass(frozen=True)
class ParamScale:
    """What μP does to one parameter: `init` multiplies its sp init std, `lr` the lr of an entrywise optimizer
    (Adam, Lion), `muon_lr` Muon's lr where Muon orthogonalizes the parameter (the module docstring)."""

    init: float
    lr: float
    muon_lr: float = 1.0


@dataclass(frozen=True)
class MupPlan:
    """The whole parametrization of one model: `width_mult` = dim / mup_base_dim, `output_multiplier` on the
    logits, `attention_scale` on q·k (sp: 1/sqrt(head_dim)), and every parameter's `ParamScale` by name."""

    width_mult: float
    output_multiplier: float
    attention_scale: float
    params: dict[str, ParamScale]


def base_config(cfg: ModelConfig) -> ModelConfig:
    """The base model whose fan-ins the multipliers are measured against: `cfg` at dim = mup_base_dim, its
    FFN width scaled in proportion when set explicitly (ModelConfig checks that it divides exactly).
    Only the fan-ins of its 2-D weights are read, and the head layout changes none of them (q, k, v read
    dim; wo reads n_heads · head_dim = dim), so the base is laid out as one head: a width grown by heads
    of a fixed size and one grown by wider heads have the same base."""
    base = cfg.mup_base_dim
    ffn = None if cfg.ffn_hidden_dim is None else cfg.ffn_hidden_dim * base // cfg.dim
    return cfg.model_copy(update={"dim": base, "ffn_hidden_dim": ffn, "n_heads": 1, "n_kv_heads": None})


def mup_plan(cfg: ModelConfig) -> MupPlan | None:
    """The μP plan of `cfg`, or None under sp."""
    if cfg.parametrization != "mup":
        return None
    base_shapes = {p.name: p.shape for p in spec_for(cfg).param_specs(base_config(cfg))}
    params = {}
    for p in spec_for(cfg).param_specs(cfg):
        if isinstance(p.owner, int) and len(p.shape) == 2:  # a hidden matrix [out, in]
            ratio = base_shapes[p.name][-1] / p.shape[-1]
            params[p.name] = ParamScale(init=math.sqrt(ratio), lr=ratio, muon_lr=math.sqrt(ratio))
        else:  # a tied head is the embedding's parameter: its spec is the embedding's, owner "embedding"
            params[p.name] = ParamScale(init=0.0 if p.owner == "head" else 1.0, lr=1.0)
    width_mult = cfg.dim / cfg.mup_base_dim
    return MupPlan(width_mult, 1 / width_mult, 1 / cfg.head_dim, params)


def query_scale(cfg: ModelConfig) -> float:
    """What the queries are multiplied by before the attention kernel (which divides q·k by sqrt(head_dim)),
    so that the logits are q·k · attention_scale: 1/sqrt(head_dim) under μP, 1 under sp."""
    plan = mup_plan(cfg)
    return 1.0 if plan is None else plan.attention_scale * math.sqrt(cfg.head_dim)


def output_multiplier(cfg: ModelConfig) -> float:
    """What the final-normed hidden states are multiplied by before the head (= the logits' multiplier)."""
    plan = mup_plan(cfg)
    return 1.0 if plan is None else plan.output_multiplier


def summary(cfg: ModelConfig) -> dict | None:
    """The plan as validate-config shows it: the scalars, and the parameters grouped by their factors,
    layer indices replaced by `*` (e.g. "layers.*.feed_forward.w2.weight")."""
    plan = mup_plan(cfg)
    if plan is None:
        return None
    groups: dict[tuple[float, float, float], list[str]] = {}
    for name, scale in plan.params.items():
        pattern = re.sub(r"\.\d+\.", ".*.", name)
        names = groups.setdefault((scale.init, scale.lr, scale.muon_lr), [])
        if pattern not in names:
            names.append(pattern)
    return {
        "base_dim": cfg.mup_base_dim,
        "width_mult": plan.width_mult,
        "output_multiplier": plan.output_multiplier,
        "attention_scale": plan.attention_scale,
        "groups": [
            {"init_std_mult": i, "lr_mult": lr, "muon_lr_mult": muon, "params": names}
            for (i, lr, muon), names in groups.items()
        ],
    }
