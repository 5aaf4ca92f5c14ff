"""Hugging Face interoperability: export a Forge checkpoint as a `transformers` model folder, import one
as a Forge checkpoint, and load one's weights straight into a model.

An exported folder holds config.json (the class the model family's `HFMapping` picks: for the transformer
LlamaForCausalLM, or Qwen3ForCausalLM for qk_norm models; MoE models as Qwen2-MoE, Qwen3-MoE or GLM-4-MoE;
see engine/model/families/transformer/hf.py), the weights as model.safetensors (or
model-0000i-of-0000n.safetensors + an index above `max_shard_bytes`), generation_config.json, and the
run's tokenizer as tokenizer.json + tokenizer_config.json (starting every text with the end-of-text token, as
`forge generate` starts a prompt), so `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained(folder)` work offline.

An imported checkpoint is a checkpoint folder like the one a run writes, so anything that takes a Forge
checkpoint takes it:

    OUT/step_0/      the weights in DCP format (model only, no optimizer), train_state.json, COMPLETE
    OUT/latest       "step_0"
    OUT/model.toml   the [model] section that matches the weights (copy it into a preset)
    OUT/tokenizer.json   the HF folder's tokenizer (and its tokenizer_config.json), when it has one

Both directions stream: export reads the checkpoint one output file's worth of tensors at a time, and
import holds the weights once (never a model plus a copy). Output goes to a hidden temporary folder next
to OUT that is renamed to OUT only when complete, so a failure or a kill never leaves a partial OUT.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tokenizers import processors
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from engine.checkpoint.dcp import (
    COMPLETE,
    LATEST,
    PARAMETRIZATION_KEY,
    TRAIN_STATE,
    SafeFileSystemReader,
    describe,
    read_state,
    single_process_quiet,
)
from engine.checkpoint.hf_mapping import (
    Piece,
    check_same_architecture,
    expected_state,
    forge_sources,
    from_hf,
    hf_architecture,
    hf_config,
    hf_layout,
    hf_shapes,
    mapping,
    model_config_from_hf,
    skipped_on_import,
    source_groups,
    to_hf,
    unstored_state,
)
from engine.checkpoint.locate import MODEL_CONFIG, TOKENIZER, ForgeCheckpoint, averaged, find_checkpoint, merged
from engine.config.model import ModelConfig
from engine.data.tokenizer import Encoder, adds_special_tokens, parse_tokenizer
from engine.durable import fsync_dir, fsync_file
from engine.errors import UserError
from engine.model.spec import spec_for
from engine.safe_paths import file_in

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' own default shard size ("5GB")
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass(frozen=True)
class ConvertProgress:
    """Reported after every tensor: parameters (weights) converted so far, of the total."""

    done: int
    total: int
    tensor: str


ProgressFn = Callable[[ConvertProgress], None]


@dataclass(frozen=True)
class ConvertReport:
    source: Path  # the checkpoint or HF folder read
    out: Path
    architecture: str  # the HF class on the HF side
    model: ModelConfig
    parameters: int
    bytes: int  # weight bytes written
    files: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # what the checkpoint holds and the export does not


def is_hf_folder(path: Path) -> bool:
    """A Hugging Face model folder (config.json inside), as opposed to a Forge checkpoint."""
    return path.is_dir() and (path / "config.json").is_file()


# ---------------------------------------------------------------- Forge → Hugging Face


def export_to_hf(
    source: Path,
    out: Path,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: ProgressFn | None = None,
    ema: bool = False,
    merge: bool = False,
) -> ConvertReport:
    """Write the newest complete checkpoint of `source` (run directory, checkpoint folder or step_N) as a
    Hugging Face model folder `out`, weights cast to `dtype` (unset: the run's checkpoint.export_dtype, so a
    preset can say how its run ships); `ema`: the EMA of the weights the run kept;
    `merge`: a LoRA run's adapters added into their base weights (a plain model; `hf_lora.export_adapters`
    writes them as a peft adapter instead). Everything is checked before anything is written."""
    ckpt = find_checkpoint(source, ema=ema)
    torch_dtype = export_dtype(dtype or ckpt.export_dtype)
    check_merge(ckpt, merge)
    cfg = ckpt.model
    architecture = hf_architecture(cfg)
    layout = hf_layout(cfg)
    names = forge_sources(layout)
    saved = saved_tensors(ckpt.path, cfg, names)
    encoder = Encoder.from_file(ckpt.tokenizer) if ckpt.tokenizer else None
    check_out(out)
    shards = plan_shards(source_groups(layout), saved, torch_dtype.itemsize, max_shard_bytes)
    parameters = sum(saved[n].size.numel() for n in names)
    tokenizer = export_tokenizer(encoder, cfg.max_seq_len) if encoder is not None else None
    eos_id, bos_id = (encoder.eos_id, tokenizer.bos_id) if tokenizer is not None else (None, None)
    with staging(out) as tmp:
        files, weight_bytes = write_safetensors(tmp, ckpt, layout, saved, shards, torch_dtype, progress)
        write_json(tmp / "config.json", hf_config(cfg, torch_dtype, eos_id, bos_id))
        write_json(
            tmp / "generation_config.json",
            {"bos_token_id": bos_id, **({"eos_token_id": eos_id} if eos_id is not None else {})},
        )
        if tokenizer is not None:
            (tmp / TOKENIZER).write_bytes(tokenizer.json_bytes)
            write_json(tmp / TOKENIZER_CONFIG, tokenizer.config)
    return ConvertReport(ckpt.path, out, architecture, cfg, parameters, weight_bytes, files, left_out(cfg))


def left_out(cfg: ModelConfig) -> list[str]:
    """What of a checkpoint an export leaves out: the multi-token-prediction modules (the HF classes Forge
    writes run the main model; so do `forge generate` and evaluation)."""
    if not cfg.mtp_depth:
        return []
    return [
        f"the {cfg.mtp_depth} multi-token-prediction module(s) (model.mtp_depth = {cfg.mtp_depth}): "
        "the export is the main model, which is what generation uses"
    ]


def check_merge(ckpt: ForgeCheckpoint, merge: bool) -> None:
    """A LoRA run exports merged (or as an adapter); a plain run has nothing to merge."""
    if ckpt.lora is None:
        if merge:
            raise UserError(
                f"{ckpt.path} was not trained with [lora]: it has no adapters to merge", "leave out --merge"
            )
        return
    if not merge:
        raise UserError(
            f"{ckpt.path} holds LoRA adapters beside a frozen base; exported alone the base would lose them",
            "pass --merge (one plain model: base + adapters) or --adapters-only (a peft adapter for the base)",
        )
    if ckpt.lora.save_adapters_only:
        raise UserError(
            f"{ckpt.path} holds only the adapters (lora.save_adapters_only), not the base to merge them into",
            f"export them with --adapters-only and load them onto the base from {ckpt.base_path or 'the seed'}",
        )


def export_dtype(name: str) -> torch.dtype:
    if name not in EXPORT_DTYPES:
        raise UserError(f"--dtype {name!r} is not an export dtype", f"use one of {', '.join(EXPORT_DTYPES)}")
    return EXPORT_DTYPES[name]


def saved_tensors(step: Path, cfg: ModelConfig, names: list[str]) -> dict[str, TensorStorageMetadata]:
    """The checkpoint's model tensors (from DCP's metadata, no weights read), checked against its config."""
    try:
        metadata = SafeFileSystemReader(step).read_metadata().state_dict_metadata
    except (OSError, ValueError, EOFError, pickle.UnpicklingError) as e:
        raise UserError(f"cannot read checkpoint {step} ({e})", "is it a folder written by forge train?") from None
    shapes = {name: tensor.shape for name, tensor in expected_state(cfg).items()}
    saved = {}
    for name in names:
        meta = metadata.get(f"model.{name}")
        if not isinstance(meta, TensorStorageMetadata):
            raise UserError(
                f"checkpoint {step} has no tensor model.{name}, which its [model] config needs",
                "the config beside the checkpoint does not describe it; was it edited?",
            )
        if meta.size != shapes[name]:
            raise UserError(
                f"checkpoint {step}: model.{name} has shape {list(meta.size)}, its [model] config "
                f"says {list(shapes[name])}",
                "the config beside the checkpoint does not describe it",
            )
        saved[name] = meta
    return saved


def plan_shards(
    groups: list[tuple[str, ...]], saved: dict[str, TensorStorageMetadata], itemsize: int, max_shard_bytes: int
) -> list[list[str]]:
    """Forge FQNs split into files of at most max_shard_bytes (a larger tensor gets a file of its own); the
    tensors of one group (`source_groups`: those one fused HF tensor is made of) go to the same file."""
    shards: list[list[str]] = [[]]
    size = 0
    for group in groups:
        nbytes = sum(saved[name].size.numel() for name in group) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(group)
        size += nbytes
    return shards


def write_safetensors(
    out: Path,
    ckpt: ForgeCheckpoint,
    layout: dict[str, Piece],
    saved: dict[str, TensorStorageMetadata],
    shards: list[list[str]],
    dtype: torch.dtype,
    progress: ProgressFn | None,
) -> tuple[list[str], int]:
    """Read each file's Forge tensors from the checkpoint (DCP reassembles any sharded layout), turn them
    into their HF tensors (one per expert for packed experts), cast, write. A schedule-free run ships its
    averaged weights; asked for the EMA, the EMA. Returns the files and the weight bytes written."""
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    file_of = hf_files(layout, shards)
    total = sum(saved[name].size.numel() for shard in shards for name in shard)
    weight_map, done, total_bytes = {}, 0, 0
    for index, (file, shard) in enumerate(zip(files, shards)):
        tensors = read_checkpoint_tensors(ckpt, {name: saved[name] for name in shard})
        converted = {}
        for hf_name, piece in layout.items():
            if file_of[hf_name] != index:
                continue
            converted[hf_name] = to_hf(piece, tensors, dtype)
            weight_map[hf_name] = file
            done += converted[hf_name].numel() if piece.source is not None else 0
            total_bytes += converted[hf_name].nbytes
            if progress:
                progress(ConvertProgress(done, total, hf_name))
        del tensors
        save_file(converted, out / file, metadata={"format": "pt"})
        del converted
    if len(files) > 1:
        write_json(out / INDEX_FILE, {"metadata": {"total_size": total_bytes}, "weight_map": weight_map})
        files.append(INDEX_FILE)
    return files, total_bytes


def hf_files(layout: dict[str, Piece], shards: list[list[str]]) -> dict[str, int]:
    """HF name → index of the file it goes to: that of its Forge source (zeros go with the tensor before them)."""
    shard_of = {name: i for i, shard in enumerate(shards) for name in shard}
    file_of, last = {}, 0
    for hf_name, piece in layout.items():
        last = shard_of[piece.source] if piece.source is not None else last
        file_of[hf_name] = last
    return file_of


def read_checkpoint_tensors(ckpt: ForgeCheckpoint, wanted: dict[str, TensorStorageMetadata]) -> dict[str, torch.Tensor]:
    """Just these model tensors of a DCP checkpoint, whole, in their saved dtype, in this process."""
    step = ckpt.path
    tensors = {name: torch.empty(meta.size, dtype=meta.properties.dtype) for name, meta in wanted.items()}
    try:
        read_state(step, {"model": tensors})
        averaged(ckpt, tensors)
        merged(ckpt, tensors)
    except (CheckpointException, OSError) as e:  # a shard file missing or cut short
        raise UserError(
            f"cannot read checkpoint {step} ({describe(e)})",
            "its files are damaged or incomplete; use another step_N folder",
        ) from None
    return tensors


@dataclass(frozen=True)
class ExportedTokenizer:
    json_bytes: bytes  # tokenizer.json
    config: dict[str, Any]  # tokenizer_config.json
    bos_id: int | None  # the token it starts every text with, if any


def export_tokenizer(encoder: Encoder, max_seq_len: int) -> ExportedTokenizer:
    """The run's tokenizer, made to start a text as `forge generate` starts a prompt (engine.generate.prompt_ids):
    Forge trains every document right after the end-of-text token, so a tokenizer that adds nothing of its own
    gets a post-processor that puts that token first, as a BOS; then `tok(text)` in transformers (and
    `encode(text)` in tokenizers) gives the ids forge generate feeds the model. One that adds its own start
    tokens (a Llama BOS) already does, as prompt_ids uses them, and is written as it is. The run directory's
    tokenizer.json, which training and tokenizing read without special tokens, is not touched."""
    tokenizer = parse_tokenizer(encoder.json_bytes, TOKENIZER)  # a copy: encoder.tokenizer is shared
    json_bytes = encoder.json_bytes
    if not adds_special_tokens(tokenizer):
        eos = encoder.eos_token
        start = processors.TemplateProcessing(
            single=f"{eos}:0 $A:0", pair=f"{eos}:0 $A:0 {eos}:1 $B:1", special_tokens=[(eos, encoder.eos_id)]
        )
        kept = tokenizer.post_processor  # e.g. byte-level offset trimming, which adds no tokens
        tokenizer.post_processor = start if kept is None else processors.Sequence([kept, start])
        json_bytes = tokenizer.to_str(pretty=True).encode()
    first = tokenizer.encode("a")  # a special token before the text is the BOS
    bos_id = first.ids[0] if first.special_tokens_mask[:1] == [1] else None
    # No add_bos_token: transformers drops it when there is a tokenizer.json, whose post-processor decides.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": encoder.eos_token,
        **({"bos_token": first.tokens[0]} if bos_id is not None else {}),
        "model_max_length": max_seq_len,
        "clean_up_tokenization_spaces": False,
    }
    return ExportedTokenizer(json_bytes, config, bos_id)


# ---------------------------------------------------------------- Hugging Face → Forge


def import_from_hf(
    hf_dir: Path,
    out: Path,
    progress: ProgressFn | None = None,
    updates: Callable[[ModelConfig], dict[str, torch.Tensor]] | None = None,
) -> ConvertReport:
    """Write the weights of a local HF folder of an architecture `hf_mapping` reads (Llama, Qwen3, and
    the MoE ones) as a Forge checkpoint folder `out` (layout in the module docstring). `updates`, given the
    folder's model config: Forge weight name → an fp32 change added to that weight on the way (a peft
    adapter merged in, `hf_lora.import_with_adapter`). Everything is checked before anything is written."""
    cfg = read_hf_model_config(hf_dir)
    architecture = hf_architecture(cfg)
    files = safetensors_files(hf_dir)
    layout = check_hf_tensors(hf_dir, files, cfg)
    changes = updates(cfg) if updates is not None else {}
    check_out(out)
    meta = expected_state(cfg)
    total = sum(meta[name].numel() for name in forge_sources(layout))
    has_tokenizer = (hf_dir / TOKENIZER).is_file()
    tokenizer_files = [name for name in (TOKENIZER, TOKENIZER_CONFIG) if has_tokenizer and (hf_dir / name).is_file()]
    with staging(out) as tmp:
        state, done, weight_bytes = {}, 0, 0
        for tensors in forge_tensors(hf_dir, files, layout):
            for name, loaded in tensors.items():
                delta = changes.get(name)
                tensor = loaded if delta is None else (loaded.float() + delta).to(loaded.dtype)
                state[name] = tensor
                done, weight_bytes = done + tensor.numel(), weight_bytes + tensor.nbytes
                if progress:
                    progress(ConvertProgress(done, total, name))
        if cfg.tie_embeddings:  # what a tied model's state dict holds: the head's weight is the embedding's
            embedding, head = spec_for(cfg).parts.tied
            state[f"{head}.weight"] = state[f"{embedding}.weight"]
        for name, tensor in meta.items():  # training state HF folders do not hold (the family's mapping says)
            if name not in state and name.endswith(unstored_state(cfg)):
                state[name] = torch.zeros(tensor.shape, dtype=tensor.dtype)
        write_forge_checkpoint(tmp, state, cfg, hf_dir)
        for name in tokenizer_files:  # the config beside tokenizer.json names its end-of-text token
            shutil.copyfile(hf_dir / name, tmp / name)
    return ConvertReport(
        hf_dir, out, architecture, cfg, total, weight_bytes, ["step_0", LATEST, MODEL_CONFIG, *tokenizer_files]
    )


def read_hf_model_config(hf_dir: Path) -> ModelConfig:
    if not hf_dir.is_dir():
        what = "is not a folder" if hf_dir.exists() else "does not exist"
        raise UserError(f"{hf_dir} {what}", "pass a local Hugging Face model folder (config.json + *.safetensors)")
    path = hf_dir / "config.json"
    if not path.is_file():
        raise UserError(
            f"{hf_dir} has no config.json, so it is not a Hugging Face model folder",
            "pass the folder that save_pretrained wrote (config.json + *.safetensors)",
        )
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e})", "restore the file from the model's source") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a JSON object", "restore the file from the model's source")
    return model_config_from_hf(config, str(hf_dir))


def safetensors_files(hf_dir: Path) -> list[Path]:
    """The weight files of an HF folder: model.safetensors, or every file its index names."""
    index = hf_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{index} is not a valid safetensors index ({e})", "restore the file") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(f"{index}: weight_map is not a non-empty JSON object", "restore the file")
        # The index names the weight files beside it; a name leading elsewhere (`/dev/zero`, `../other/x`) is
        # refused before anything is opened.
        files = [file_in(hf_dir, name, index) for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UserError(
                f"{hf_dir} is missing weight files named in {INDEX_FILE}: {', '.join(missing)}",
                "download the complete model folder",
            )
        return files
    if (hf_dir / SINGLE_FILE).is_file():
        return [hf_dir / SINGLE_FILE]
    if any(hf_dir.glob("*.bin")) or any(hf_dir.glob("*.pth")):
        raise UserError(
            f"{hf_dir} holds its weights as pickled .bin/.pth files, which Forge does not read",
            "re-save the model with safe_serialization=True (the default of save_pretrained)",
        )
    raise UserError(f"{hf_dir} has no {SINGLE_FILE} or {INDEX_FILE}", "download the model's *.safetensors files too")


def check_hf_tensors(hf_dir: Path, files: list[Path], cfg: ModelConfig) -> dict[str, Piece]:
    """HF name, as the folder's files spell it → how it makes part of the Forge state dict (`hf_layout`), after
    checking from the file headers alone (no weights read) that the folder holds every tensor `cfg` needs with
    the right shape, and nothing Forge's model has no place for. A name without the family's
    `base_model_prefix` stands for the prefixed one."""
    wanted = hf_layout(cfg)
    shapes = hf_shapes(cfg, wanted)
    prefix = mapping(cfg).base_model_prefix
    found: dict[str, str] = {}  # layout name → the name in the files
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for stored in f.keys():
                    name = stored if stored in wanted or prefix is None else prefix + stored
                    if name in wanted:
                        shape = list(f.get_slice(stored).get_shape())
                        if shape != list(shapes[name]):
                            raise UserError(
                                f"{file.name}: {stored} has shape {shape}, config.json implies {list(shapes[name])}",
                                "the weights do not match config.json",
                            )
                        found[name] = stored
                    elif not skipped_on_import(cfg, stored) and not skipped_on_import(cfg, name):
                        raise UserError(
                            f"{file.name} holds {stored}, which a {hf_architecture(cfg)} of this config has no place for",
                            "is config.json the one these weights were saved with?",
                        )
        except SafetensorError as e:
            raise UserError(f"{file} is not a readable safetensors file ({e})", "download it again") from None
    missing = [name for name in wanted if name not in found]
    if missing:
        raise UserError(
            f"{hf_dir} lacks {len(missing)} weight(s) its config.json needs, e.g. {missing[0]}",
            "download the complete model folder",
        )
    return {found[name]: piece for name, piece in wanted.items()}


def forge_tensors(hf_dir: Path, files: list[Path], layout: dict[str, Piece]) -> Iterator[dict[str, torch.Tensor]]:
    """For each weight file in turn, the Forge tensors completed by reading it: most come from one HF
    tensor, a packed expert tensor from one per expert (stacked once all are read, in whichever files)."""
    experts = Counter(piece.source for piece in layout.values() if piece.expert is not None)
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for file in files:
        done = {}
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                piece = layout.get(name)
                if piece is None or piece.source is None:
                    continue
                tensor = f.get_tensor(name)
                if piece.expert is None:  # whole Forge tensors (several, for a fused HF tensor)
                    done.update(from_hf(piece, tensor))
                    continue
                tensor = tensor.T.contiguous() if piece.transpose else tensor
                parts = pending.setdefault(piece.source, {})
                parts[piece.expert] = tensor
                if len(parts) == experts[piece.source]:
                    done[piece.source] = torch.stack([parts[e] for e in range(len(parts))])
                    del pending[piece.source]
        yield done
    assert not pending, f"incomplete expert tensors {list(pending)}"  # check_hf_tensors saw every piece


def write_forge_checkpoint(root: Path, state: dict[str, torch.Tensor], cfg: ModelConfig, hf_dir: Path) -> None:
    """step_0 in the layout `engine.checkpoint.dcp` writes (model only), latest, and model.toml."""
    step = root / "step_0"
    step.mkdir()
    with single_process_quiet():
        dcp.save({"model": state}, checkpoint_id=step, no_dist=True)
    # Hugging Face weights are a standard parametrization's (an export folds μP's multipliers in)
    write_json(step / TRAIN_STATE, {"step": 0, "converted_from": str(hf_dir.resolve()), PARAMETRIZATION_KEY: "sp"})
    (step / COMPLETE).write_text("")
    (root / LATEST).write_text(step.name)
    (root / MODEL_CONFIG).write_text(model_toml(cfg))


def model_toml(cfg: ModelConfig) -> str:
    """The [model] section of a preset for these weights (a file that is itself a valid preset)."""
    import tomlkit

    doc = tomlkit.document()
    doc.add(tomlkit.comment("[model] section matching weights converted from Hugging Face; copy it into a preset."))
    doc.add("model", cfg.model_dump(mode="json", exclude_none=True))
    return tomlkit.dumps(doc)


def load_hf_weights(model: nn.Module, hf_dir: Path, exclude: Sequence[str] = ()) -> list[str]:
    """Copy the weights of an HF folder into `model` in place, one safetensors file at a time; `model` may
    be plain or sharded (FSDP2: each rank keeps its shard of the full tensors it is given). The folder's
    config must describe the same architecture as `model.cfg` (a UserError names the first difference).
    Forge names under an `exclude` prefix keep their values. Returns the Forge names loaded."""
    hf_cfg = read_hf_model_config(hf_dir)
    check_same_architecture(model.cfg, hf_cfg, str(hf_dir))
    files = safetensors_files(hf_dir)
    # In the model's own expert layout (packed or not); hf_cfg, not model.cfg, whose training-only settings
    # (a capacity limit) would refuse an export but do not matter for loading.
    layout = check_hf_tensors(
        hf_dir, files, hf_cfg.model_copy(update={"moe_packed_experts": model.cfg.moe_packed_experts})
    )
    options = StateDictOptions(full_state_dict=True, strict=False)
    loaded: list[str] = []
    for completed in forge_tensors(hf_dir, files, layout):
        tensors = {name: tensor for name, tensor in completed.items() if not name.startswith(tuple(exclude))}
        loaded += tensors  # before the call: set_model_state_dict adds entries to the dict it is given
        set_model_state_dict(model, tensors, options=options)
    return sorted(loaded)


# ---------------------------------------------------------------- output folders


def check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} already exists", "pass a new folder (or remove the old one first)")


@contextlib.contextmanager
def staging(out: Path) -> Iterator[Path]:
    """A temporary folder beside `out` to write into; renamed to `out` (durably) only if the block succeeds."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    except OSError as e:
        raise UserError(
            f"cannot write into {out.parent} ({e.strerror or e})", "pass --out in a folder you can write"
        ) from None
    try:
        yield tmp
        umask = current_umask()
        for path in sorted(tmp.rglob("*")):
            if path.is_file():
                path.chmod(0o666 & ~umask)  # safetensors writes owner-only files; make all read like the rest
                fsync_file(path)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes the folder owner-only too
        os.rename(tmp, out)  # also replaces an empty `out` folder
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def current_umask() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
