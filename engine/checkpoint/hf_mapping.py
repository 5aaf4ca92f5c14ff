"""How a Forge model corresponds to a Hugging Face `transformers` model, both ways, for any model family.

What corresponds to what is the family's (`ModelSpec.hf`, an `HFMapping`: its HF classes and config.json,
and HF tensor name → `Piece`, how the tensor is made from the Forge state dict); this module looks the
family up and moves the tensors: shapes, transposes, one expert of a packed tensor, dtypes. A family without
a mapping, or a config its mapping has no exact equivalent for, is a UserError naming the field, never an
export under a name that would compute something different.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from engine.config.model import ModelConfig
from engine.config.registry import MODELS
from engine.errors import UserError
from engine.model import build_model
from engine.model.spec import HFMapping, ModelSpec, Piece, spec_for

__all__ = [
    "Piece",
    "check_same_architecture",
    "expected_shapes",
    "expected_state",
    "forge_sources",
    "from_hf",
    "hf_architecture",
    "hf_config",
    "hf_layout",
    "hf_shapes",
    "mapping",
    "model_config_from_hf",
    "skipped_on_import",
    "source_groups",
    "to_hf",
    "unstored_state",
]


def mapping(cfg: ModelConfig) -> HFMapping:
    """The Hugging Face mapping of `cfg`'s family, or a UserError when it has none."""
    hf = spec_for(cfg).hf
    if hf is None:
        exporting = [name for name in MODELS.names() if MODELS.get(name).spec.hf is not None]
        raise UserError(
            f"model.model_type = {cfg.model_type!r} has no Hugging Face counterpart",
            f"Hugging Face conversion exists for the model types {', '.join(exporting)}",
        )
    return hf


def hf_architecture(cfg: ModelConfig) -> str:
    """The `transformers` class that computes exactly what `cfg` does, or a UserError naming the field."""
    return mapping(cfg).architecture(cfg)


def hf_config(cfg: ModelConfig, torch_dtype: torch.dtype, eos_id: int | None, bos_id: int | None) -> dict[str, Any]:
    """config.json for `cfg` with weights in `torch_dtype`, whose tokenizer ends documents with `eos_id` and
    starts texts with `bos_id`."""
    return mapping(cfg).config(cfg, str(torch_dtype).removeprefix("torch."), eos_id, bos_id)


def hf_layout(cfg: ModelConfig) -> dict[str, Piece]:
    """HF tensor name → how to make it from the Forge state dict, for every tensor an HF folder of `cfg`
    stores, in model order (a tied head is stored once, as the embedding)."""
    return mapping(cfg).layout(cfg)


def skipped_on_import(cfg: ModelConfig, name: str) -> bool:
    """Whether an HF folder of `cfg` may hold tensor `name` that the import skips: a derived buffer, or the
    head of a tied model stored besides the embedding."""
    hf = mapping(cfg)
    return name.endswith(hf.ignored_suffixes) or (cfg.tie_embeddings and name == hf.tied_head)


def unstored_state(cfg: ModelConfig) -> tuple[str, ...]:
    """Name suffixes of the Forge state an HF folder does not hold (training state such as a router's
    balancing counters), which an import sets to zeros."""
    return mapping(cfg).unstored_state


def model_config_from_hf(config: dict[str, Any], source: str) -> ModelConfig:
    """The `[model]` section that computes what an HF config.json describes, by the family that reads its
    architecture; anything no family reproduces exactly is a UserError."""
    model_type, named = config.get("model_type"), config.get("architectures") or []
    for spec in families_with_hf():
        for architecture, expected_type in spec.hf.model_types.items():
            if model_type == expected_type and (not named or architecture in named):
                return spec.hf.model_config(config, source)
    what = f"model_type {model_type!r}" + (f" ({', '.join(map(str, named))})" if named else "")
    readable = ", ".join(
        f'{name} (model_type "{kind}")' for spec in families_with_hf() for name, kind in spec.hf.model_types.items()
    )
    raise UserError(f"{source} holds a {what} model, which Forge cannot load", f"Forge reads {readable} folders")


def families_with_hf() -> list[ModelSpec]:
    """The registered families that have a Hugging Face mapping (importing engine.model registered them)."""
    return [MODELS.get(name).spec for name in MODELS.names() if MODELS.get(name).spec.hf is not None]


def check_same_architecture(model_cfg: ModelConfig, hf_cfg: ModelConfig, source: str) -> None:
    """A model about to receive `source`'s weights must compute what they were trained for."""
    for field in ("model_type", *mapping(model_cfg).architecture_fields):
        ours, theirs = getattr(model_cfg, field), getattr(hf_cfg, field)
        if ours != theirs:
            raise UserError(
                f"model.{field} = {ours!r}, but the Hugging Face model in {source} has {theirs!r}",
                f"set model.{field} = {theirs!r} (`forge convert from-hf` prints the matching [model] section)",
            )


def forge_sources(layout: dict[str, Piece]) -> list[str]:
    """The Forge tensors a layout reads, in order, each once."""
    return [name for group in source_groups(layout) for name in group]


def source_groups(layout: dict[str, Piece]) -> list[tuple[str, ...]]:
    """The Forge tensors a layout reads, in order, each once, grouped by what must be read together: the
    sources of one fused HF tensor form one group, any other tensor a group of its own."""
    groups, seen = [], set()
    for piece in layout.values():
        group = tuple(name for name in piece.sources if name not in seen)
        if group:
            groups.append(group)
            seen.update(group)
    return groups


def hf_shapes(cfg: ModelConfig, layout: dict[str, Piece]) -> dict[str, torch.Size]:
    """HF name → the shape that tensor has in an HF folder of `cfg`."""
    forge = expected_shapes(cfg)
    shapes = {}
    for name, piece in layout.items():
        if piece.source is None:
            shapes[name] = torch.Size(piece.shape)
            continue
        shape = forge[piece.source][1:] if piece.expert is not None else forge[piece.source]
        if piece.fused:  # the sources stacked along dim 0
            shape = torch.Size((shape[0] * len(piece.sources), *shape[1:]))
        shapes[name] = torch.Size(reversed(shape)) if piece.transpose else shape
    return shapes


def to_hf(piece: Piece, state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The HF tensor `piece` describes, from the Forge tensors in `state` (FQN → tensor; at least the piece's
    sources), times its scale, in `dtype` (fp32 pieces stay fp32)."""
    dtype = torch.float32 if piece.fp32 else dtype
    if piece.source is None:
        return torch.zeros(piece.shape, dtype=dtype)
    if piece.fused:
        tensor = torch.cat([state[name] for name in piece.sources])
    else:
        tensor = state[piece.source] if piece.expert is None else state[piece.source][piece.expert]
    if piece.scale != 1.0:  # in the source's precision (fp32 in checkpoints), before the cast
        tensor = tensor * piece.scale
    return (tensor.T if piece.transpose else tensor).to(dtype).contiguous()


def from_hf(piece: Piece, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The Forge tensors (FQN → tensor) one HF tensor of `piece` holds whole: its source, or for a fused
    piece each of its sources; {} for an expert's slice, which the caller stacks with the others."""
    tensor = tensor.T.contiguous() if piece.transpose else tensor
    if piece.fused:
        parts = tensor.chunk(len(piece.sources))
        return {name: part.clone() for name, part in zip(piece.sources, parts, strict=True)}
    return {piece.source: tensor} if piece.expert is None else {}


def expected_state(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Forge FQN → meta tensor (shape and dtype), from the model itself built on the meta device (no
    memory, no init cost)."""
    with torch.device("meta"):
        model = build_model(cfg)
    return model.state_dict()


def expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Forge FQN → shape."""
    return {name: tensor.shape for name, tensor in expected_state(cfg).items()}
