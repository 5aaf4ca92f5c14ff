"""The on-disk form of an extraction, and reading it back.

Why safetensors: it stores bf16 natively (`.npy` has no bf16, which is what broke the seed framework's
`.npz`), its header is a small JSON with each tensor's dtype, shape and byte range, so a shard is
memory-mapped with one `np.memmap` per tensor and no copy, and any tool with the `safetensors` package reads it.

An output folder holds
- `request.json`: what was asked (written first; a rerun with other arguments is refused, the same ones resume);
- `tokens.npy`: the token ids the windows cover, in order;
- `shard-NNNNN.safetensors`: consecutive rows (window, position) of every requested layer, one tensor per
  layer; each is filled batch by batch into a preallocated temporary file and renamed into place when full,
  so a shard on disk is always complete and memory holds one batch;
- `manifest.json`, written last: a folder with a manifest is a finished extraction.
With `--format npz` the shards are joined into one `activations.npz` (one array per layer, bf16 kept as its
uint16 bit pattern and named in the manifest) before the manifest is written, then removed.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.durable import TMP_SUFFIX, atomic_write, fsync_dir, write_durably
from engine.errors import UserError
from engine.safe_paths import file_in

FORMAT = "forge-activations"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
REQUEST = "request.json"
TOKENS = "tokens.npy"
NPZ = "activations.npz"
TOKENS_KEY = "tokens"

# safetensors dtype names ↔ torch dtypes, and the numpy dtype their bytes are read as (bf16 as its bits)
DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int32: "I32"}
STORAGE = {"F32": np.float32, "BF16": np.uint16, "F16": np.float16, "I32": np.int32}
TORCH_OF = {name: dtype for dtype, name in DTYPES.items()}


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def dumps(data: dict) -> bytes:
    """Canonical JSON (sorted keys): the same request always gives the same bytes."""
    return json.dumps(data, indent=2, sort_keys=True).encode() + b"\n"


@dataclass(frozen=True)
class Column:
    """One stored tensor of a shard: `name`, per-row `shape` and safetensors `dtype`."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(STORAGE[self.dtype]).itemsize


class ShardFile:
    """A safetensors file of `rows[name]` rows of each column, preallocated and filled in row order by `write`,
    then committed with `commit` (fsync and rename). Bytes are the same whatever the order of the writes."""

    def __init__(self, path: Path, columns: Sequence[Column], rows: dict[str, int]) -> None:
        self.path = path
        self.tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")
        header, offset, self.offsets = {}, 0, {}
        for column in columns:
            size = column.row_bytes * rows[column.name]
            shape = [rows[column.name], *column.shape]
            header[column.name] = {"dtype": column.dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            self.offsets[column.name] = (offset, column.row_bytes)
            offset += size
        raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
        self.data_start = 8 + len(raw)
        self.file = open(self.tmp, "wb")  # noqa: SIM115  (kept open while the batches arrive; commit closes it)
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.file.truncate(self.data_start + offset)

    def write(self, name: str, row: int, values: torch.Tensor) -> None:
        """Rows [row, row + len(values)) of column `name`."""
        offset, row_bytes = self.offsets[name]
        data = values.contiguous().view(torch.uint16) if values.dtype == torch.bfloat16 else values.contiguous()
        self.file.seek(self.data_start + offset + row * row_bytes)
        self.file.write(data.cpu().numpy().tobytes())

    def commit(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)

    def abandon(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def read_shard(path: Path) -> dict[str, np.ndarray]:
    """Name → memory-mapped array of a safetensors file (bf16 as uint16 bits; copy-on-write, so torch can wrap
    it without a warning and without touching the file)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    start = 8 + length
    arrays = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        dtype = np.dtype(STORAGE[entry["dtype"]])
        if end == begin:
            arrays[name] = np.zeros(shape, dtype)
            continue
        arrays[name] = np.memmap(path, dtype=dtype, mode="c", offset=start + begin, shape=shape)
    return arrays


TOKEN_CHUNK = 1 << 22  # tokens copied at a time: the stream itself may be larger than memory


def write_tokens(path: Path, stream: Any) -> None:
    """The token ids of a TokenStream as one uint32 `.npy`, copied chunk by chunk."""

    def write(f: Any) -> None:
        total = len(stream)
        np.lib.format.write_array_header_1_0(f, {"descr": "<u4", "fortran_order": False, "shape": (total,)})
        for start in range(0, total, TOKEN_CHUNK):
            f.write(stream.read(start, min(total, start + TOKEN_CHUNK)).astype("<u4").tobytes())

    atomic_write(path, write)


def write_npz(folder: Path, shards: Sequence[Path], columns: Sequence[Column]) -> None:
    """One `.npz` of every column joined over the shards, one column in memory at a time (for small jobs)."""

    def write(f: Any) -> None:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as archive:
            for column in columns:
                joined = np.concatenate([read_shard(path)[column.name] for path in shards])
                with archive.open(f"{column.name}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, np.ascontiguousarray(joined), allow_pickle=False)

    atomic_write(folder / NPZ, write)


def write_manifest(folder: Path, manifest: dict) -> None:
    write_durably(folder / MANIFEST, dumps({"format": FORMAT, "version": FORMAT_VERSION, **manifest}))


class LayerArray:
    """One layer's rows (tokens, *features) across shards, memory-mapped: indexing reads only what it selects.
    `numpy()` / `torch()` give the whole array (bf16 only as torch, numpy having no bf16)."""

    def __init__(self, pieces: Sequence[np.ndarray], dtype: str) -> None:
        self.pieces, self.stored = list(pieces), dtype
        self.starts = np.cumsum([0, *(len(p) for p in self.pieces)])
        self.shape = (int(self.starts[-1]), *self.pieces[0].shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_OF[self.stored]

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> np.ndarray | torch.Tensor:
        first = index[0] if isinstance(index, tuple) else index
        rest = index[1:] if isinstance(index, tuple) else ()
        if isinstance(first, slice):  # only the selected row numbers are ever made, not one per row
            chosen = range(len(self))[first]
            rows = np.arange(chosen.start, chosen.stop, chosen.step)
        elif isinstance(first, (int, np.integer)):
            rows = np.int64(range(len(self))[first])
        else:
            rows = np.asarray(first)
            rows = np.where(rows < 0, rows + len(self), rows) if rows.dtype != bool else np.flatnonzero(rows)
        if np.ndim(rows) == 0:
            piece = int(np.searchsorted(self.starts, rows, side="right") - 1)
            return self.wrap(self.pieces[piece][(rows - self.starts[piece], *rest)])
        which = np.searchsorted(self.starts, rows, side="right") - 1
        joined = np.empty((len(rows), *self.shape[1:]), self.pieces[0].dtype)
        for p in np.unique(which):  # each shard read once, rows kept in the order asked
            joined[which == p] = self.pieces[p][rows[which == p] - self.starts[p]]
        return self.wrap(joined[(slice(None), *rest)])

    def wrap(self, array: np.ndarray) -> np.ndarray | torch.Tensor:
        if self.stored != "BF16":
            return np.asarray(array)
        return torch.from_numpy(np.array(array, copy=True)).view(torch.bfloat16)

    def numpy(self) -> np.ndarray:
        if self.stored == "BF16":
            raise TypeError("numpy has no bf16: use .torch(), or .torch().float().numpy()")
        return np.concatenate(self.pieces) if len(self.pieces) > 1 else np.asarray(self.pieces[0])

    def torch(self) -> torch.Tensor:
        """The whole layer as a tensor (one shard: a view of the memory map, no copy)."""
        array = np.concatenate(self.pieces) if len(self.pieces) > 1 else self.pieces[0]
        tensor = torch.from_numpy(array)
        return tensor.view(torch.bfloat16) if self.stored == "BF16" else tensor


class Activations:
    """An extraction read back: `.tokens` (the token id of each row), `.layers`, `acts[name]` (a LayerArray),
    `.manifest` (everything the run recorded) and `.document_ends` (rows whose token ends a document)."""

    def __init__(self, folder: Path, manifest: dict, arrays: dict[str, LayerArray], stream: np.ndarray) -> None:
        self.folder, self.manifest, self.arrays = folder, manifest, arrays
        self.layers = list(manifest["layers"])
        rows = manifest["rows"]
        if rows["positions"] == "last":  # the last token of each window
            ends = np.minimum(np.arange(1, rows["windows"] + 1) * rows["seq_len"], len(stream)) - 1
            stream = np.asarray(stream[ends])
        self.tokens = stream

    def __getitem__(self, name: str) -> LayerArray:
        if name not in self.arrays:
            raise KeyError(f"{name!r} was not extracted; this folder has {', '.join(self.arrays)}")
        return self.arrays[name]

    def __contains__(self, name: str) -> bool:
        return name in self.arrays

    @property
    def document_ends(self) -> np.ndarray:
        return np.flatnonzero(self.tokens == self.manifest["eos_id"])


def load_activations(folder: str | Path) -> Activations:
    """Open a finished `forge extract` output (either format) without reading the activations into memory."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise UserError(
            f"{folder} is not a finished forge extract output (no {MANIFEST})",
            "finish the extraction: rerun the same forge extract command, it resumes",
        )
    not_ours = f"{path} is not a forge extract manifest"
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{not_ours} ({e})", "pass the --out folder of forge extract") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(not_ours, "pass the --out folder of forge extract")
    try:
        dtypes = {c["name"]: c["dtype"] for c in manifest["columns"]}
        storage, shard_names = manifest["storage"], manifest.get("shards", [])
    except (KeyError, TypeError) as e:
        raise UserError(
            f"{path} is cut short or edited ({e!r} is wrong)", "rerun forge extract into a new --out"
        ) from None
    if not isinstance(shard_names, list):
        raise UserError(f"{path}: shards is not a list", "rerun forge extract into a new --out")
    # The manifest names files beside it: a shard name leading elsewhere is refused before it is opened.
    shard_files = [file_in(folder, name, path) for name in shard_names]
    stream = np.load(file_in(folder, TOKENS, path), mmap_mode="r")
    if storage == "npz":
        with np.load(file_in(folder, NPZ, path), allow_pickle=False) as npz:
            pieces = {name: [npz[name]] for name in dtypes}
    else:
        shards = [read_shard(shard) for shard in shard_files]
        pieces = {name: [shard[name] for shard in shards] for name in dtypes}
    return Activations(folder, manifest, {name: LayerArray(pieces[name], dtypes[name]) for name in dtypes}, stream)
