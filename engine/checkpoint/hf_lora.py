"""LoRA adapters ↔ `peft` adapter folders (the `peft` package itself is not needed for either direction).

A peft LoRA adapter folder holds adapter_config.json (rank, alpha, the target modules by name) and
adapter_model.safetensors with one pair per adapted linear of the `transformers` model:

    base_model.model.<HF module>.lora_A.weight   [r, in]      = Forge's <module>.lora_A
    base_model.model.<HF module>.lora_B.weight   [out, r]     = Forge's <module>.lora_B

`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)` then computes what the
Forge model computed (tests/model/test_lora.py). Module names map through the same table as the weights
(`hf_mapping.hf_layout`: `layers.0.attention.wq` ↔ `model.layers.0.self_attn.q_proj`, `output` ↔ `lm_head`).
The target modules are written as the exact list of adapted module names, so `lora.exclude_modules` carries
over without a pattern language of peft's.

The other way, `forge convert from-hf BASE --adapter FOLDER` imports a base with a peft adapter merged into
it (W + scaling·B·A, scaling = lora_alpha / r, or / √r with use_rslora); variants that are not a plain
low-rank sum (DoRA, fan_in_fan_out, trained biases, modules_to_save) are refused.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from engine.checkpoint.dcp import SafeFileSystemReader
from engine.checkpoint.hf import (
    ConvertProgress,
    ConvertReport,
    ProgressFn,
    check_out,
    export_dtype,
    import_from_hf,
    read_checkpoint_tensors,
    staging,
    write_json,
)
from engine.checkpoint.hf_mapping import hf_architecture, hf_layout
from engine.checkpoint.locate import find_checkpoint
from engine.config.model import ModelConfig
from engine.errors import UserError

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
PARTS = ("lora_A", "lora_B")


def module_names(cfg: ModelConfig) -> dict[str, str]:
    """Forge linear module name → the `transformers` module name it is in the exported model."""
    return {
        piece.source.removesuffix(".weight"): hf_name.removesuffix(".weight")
        for hf_name, piece in hf_layout(cfg).items()
        if piece.source is not None and piece.expert is None and not piece.transpose and not piece.fused
    }


def adapter_config(rank: int, alpha: float, dropout: float, targets: list[str], base: str | None) -> dict[str, Any]:
    """adapter_config.json of a plain LoRA adapter (peft's LoraConfig fields) on `targets` (HF module names)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def export_adapters(
    source: Path, out: Path, dtype: str | None = None, progress: ProgressFn | None = None
) -> ConvertReport:
    """Write the LoRA adapters of the newest complete checkpoint of `source` as a peft adapter folder `out`
    for the model `forge convert to-hf` exports from the same run's base, in `dtype` (unset: the run's
    checkpoint.export_dtype). Checked before anything is written."""
    ckpt = find_checkpoint(source)
    torch_dtype = export_dtype(dtype or ckpt.export_dtype)
    if ckpt.lora is None:
        raise UserError(f"{ckpt.path} was not trained with [lora]: it has no adapters", "leave out --adapters-only")
    architecture = hf_architecture(ckpt.model)
    metadata = SafeFileSystemReader(ckpt.path).read_metadata().state_dict_metadata
    adapted = sorted(key.removeprefix("model.").removesuffix(".lora_A") for key in metadata if key.endswith(".lora_A"))
    names = module_names(ckpt.model)
    unmapped = [module for module in adapted if module not in names]
    if not adapted or unmapped:
        raise UserError(
            f"{ckpt.path}: adapters on {', '.join(unmapped) or 'no module'}, which the {architecture} export has no module for",
            "adapt attention and MLP projections (lora.target_modules) to export for peft",
        )
    check_out(out)
    wanted = {f"{module}.{part}": metadata[f"model.{module}.{part}"] for module in adapted for part in PARTS}
    tensors = read_checkpoint_tensors(ckpt, wanted)
    # A base weight exported times a scale (μP's query scale folded into q_proj) needs its update B·A scaled
    # alike: B carries it.
    scales = {piece.source: piece.scale for piece in hf_layout(ckpt.model).values() if piece.source is not None}
    weights = {
        f"{PEFT_PREFIX}{names[module]}.{part}.weight": (
            tensors[f"{module}.{part}"] * (scales[f"{module}.weight"] if part == "lora_B" else 1.0)
        )
        .to(torch_dtype)
        .contiguous()
        for module in adapted
        for part in PARTS
    }
    lora = ckpt.lora
    config = adapter_config(lora.rank, lora.alpha, lora.dropout, [names[m] for m in adapted], ckpt.base_path)
    with staging(out) as tmp:
        save_file(weights, tmp / PEFT_WEIGHTS, metadata={"format": "pt"})
        write_json(tmp / PEFT_CONFIG, config)
    parameters = sum(t.numel() for t in weights.values())
    if progress:
        progress(ConvertProgress(parameters, parameters, PEFT_WEIGHTS))
    nbytes = sum(t.nbytes for t in weights.values())
    return ConvertReport(
        ckpt.path, out, f"peft LoRA for {architecture}", ckpt.model, parameters, nbytes, [PEFT_CONFIG, PEFT_WEIGHTS]
    )


# ---------------------------------------------------------------- peft adapter → merged into an import


def import_with_adapter(hf_dir: Path, adapter: Path, out: Path, progress: ProgressFn | None = None) -> ConvertReport:
    """`hf.import_from_hf` of the base `hf_dir` with the peft LoRA adapter folder `adapter` merged into its
    weights: a plain Forge checkpoint of the adapted model."""
    return import_from_hf(hf_dir, out, progress, updates=lambda cfg: read_peft_adapter(adapter, cfg))


def read_peft_adapter(folder: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Forge weight name → the fp32 update scaling·B·A a peft LoRA adapter folder makes to it, for a model
    of `cfg`; anything that is not a plain LoRA on modules of that model is a UserError."""
    config = read_adapter_config(folder)
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise UserError(f"{folder / PEFT_CONFIG}: needs an integer r >= 1 and a number lora_alpha", "restore the file")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    forge_of = {hf: forge for forge, hf in module_names(cfg).items()}
    pairs = read_adapter_weights(folder)
    updates = {}
    for module, parts in sorted(pairs.items()):
        if module not in forge_of:
            raise UserError(
                f"{folder / PEFT_WEIGHTS}: an adapter on {module}, which this base model has no linear for",
                "pass the adapter that was trained on this base",
            )
        if set(parts) != set(PARTS):
            raise UserError(f"{folder / PEFT_WEIGHTS}: {module} lacks lora_A or lora_B", "restore the file")
        a, b = parts["lora_A"].float(), parts["lora_B"].float()
        if a.shape[0] != b.shape[1]:
            raise UserError(
                f"{folder / PEFT_WEIGHTS}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}",
                "restore the file",
            )
        updates[f"{forge_of[module]}.weight"] = b @ a * scaling
    if not updates:
        raise UserError(f"{folder / PEFT_WEIGHTS} holds no LoRA weights", "pass a peft LoRA adapter folder")
    return updates


def read_adapter_config(folder: Path) -> dict[str, Any]:
    path = folder / PEFT_CONFIG
    if not path.is_file():
        raise UserError(f"{folder} has no {PEFT_CONFIG}", "pass the folder peft's save_pretrained wrote")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e})", "restore the file") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise UserError(f"{path} does not describe a LoRA adapter (peft_type LORA)", "pass a peft LoRA adapter folder")
    unsupported = [
        what
        for what, bad in (
            ("use_dora = true", config.get("use_dora")),
            ("fan_in_fan_out = true", config.get("fan_in_fan_out")),
            (f"bias = {config.get('bias')!r}", config.get("bias", "none") != "none"),
            ("modules_to_save", config.get("modules_to_save")),
            ("rank_pattern / alpha_pattern", config.get("rank_pattern") or config.get("alpha_pattern")),
        )
        if bad
    ]
    if unsupported:
        raise UserError(
            f"{path}: {', '.join(unsupported)} is not a plain low-rank update Forge can merge",
            "merge it with peft (merge_and_unload + save_pretrained) and import that folder",
        )
    return config


def read_adapter_weights(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """HF module name → {"lora_A": …, "lora_B": …} from adapter_model.safetensors."""
    path = folder / PEFT_WEIGHTS
    if not path.is_file():
        raise UserError(f"{folder} has no {PEFT_WEIGHTS}", "pass the folder peft's save_pretrained wrote")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                module, _, part = key.removeprefix(PEFT_PREFIX).removesuffix(".weight").rpartition(".")
                if part not in PARTS or not key.endswith(".weight"):
                    raise UserError(f"{path} holds {key}, which is no LoRA weight", "pass a plain LoRA adapter")
                pairs.setdefault(module, {})[part] = f.get_tensor(key)
    except SafetensorError as e:
        raise UserError(f"{path} is not a readable safetensors file ({e})", "restore the file") from None
    return pairs
