"""The on-disk format: `shard-NNNNN.npy` token arrays plus a `manifest.json` that describes them.

Every file is written under a temporary name in the same directory and moved into place with `os.replace`,
so a reader (or a rerun after a crash) sees either the old file or the complete new one, never a torn one.
The manifest is written last: a directory with a manifest is a finished data set.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.durable import atomic_write
from engine.errors import DataError
from engine.safe_paths import file_in, plain_name

FORMAT = "forge-token-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SHARD_GLOB = "shard-*.npy"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.npy"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every token id: uint16 halves disk and page-cache use."""
    return np.dtype(np.uint16) if vocab_size - 1 <= np.iinfo(np.uint16).max else np.dtype(np.uint32)


@dataclass(frozen=True)
class ShardInfo:
    file: str
    tokens: int
    documents: int  # documents whose end-of-document token lies in this shard


@dataclass(frozen=True)
class Manifest:
    """What a reader needs to trust the shards: which tokenizer made them, their dtype and exact sizes."""

    tokenizer_sha256: str
    vocab_size: int
    eos_id: int
    eos_token: str
    dtype: str
    shards: tuple[ShardInfo, ...]
    source: dict[str, Any] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def total_documents(self) -> int:
        return sum(s.documents for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "tokenizer": {
                "sha256": self.tokenizer_sha256,
                "vocab_size": self.vocab_size,
                "eos_id": self.eos_id,
                "eos_token": self.eos_token,
            },
            "dtype": self.dtype,
            "total_tokens": self.total_tokens,
            "total_documents": self.total_documents,
            "shards": [asdict(s) for s in self.shards],
            "source": self.source,
        }


def read_manifest(directory: Path) -> Manifest:
    """Parse and sanity-check `directory/manifest.json`; every problem is a DataError naming the file."""
    path = directory / MANIFEST
    if not path.is_file():
        if directory.is_dir() and not any(directory.iterdir()):
            raise DataError(
                f"data directory {directory} is empty",
                f"tokenize text into it first: forge tokenize INPUT… --out {directory}",
            )
        raise DataError(
            f"{path} not found: {directory} is not a finished `forge tokenize` output",
            f"point to a directory written by forge tokenize, or run: forge tokenize INPUT… --out {directory}",
        )
    corrupt = f"delete {directory} and run forge tokenize again"
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} manifest")
        version = int(raw["version"])
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path} is corrupt ({problem(e)})", corrupt) from None
    if version > FORMAT_VERSION:
        raise DataError(
            f"{path} has format version {version}; this Forge reads up to {FORMAT_VERSION}", "upgrade Forge"
        )
    try:
        return manifest_from_json(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path} is corrupt ({problem(e)})", corrupt) from None


def problem(error: Exception) -> str:
    return f"missing field {error}" if isinstance(error, KeyError) else str(error)


def manifest_from_json(raw: dict[str, Any]) -> Manifest:
    """The manifest in `raw`; a ValueError (or KeyError, TypeError) for anything a reader cannot trust, a
    shard named by anything but a plain file name included (`engine.safe_paths`: every reader joins the
    names to the data set's folder, and a fetch into the cache writes and deletes them)."""
    tok = raw["tokenizer"]
    shards = tuple(
        ShardInfo(plain_name(s["file"], "its shard list"), int(s["tokens"]), int(s["documents"])) for s in raw["shards"]
    )
    if not shards:
        raise ValueError("it lists no shards")
    manifest = Manifest(
        str(tok["sha256"]),
        int(tok["vocab_size"]),
        int(tok["eos_id"]),
        str(tok["eos_token"]),
        str(np.dtype(raw["dtype"])),
        shards,
        dict(raw.get("source", {})),
    )
    if manifest.total_tokens != raw["total_tokens"] or manifest.total_documents != raw["total_documents"]:
        raise ValueError("total_tokens/total_documents do not add up to the shard entries")
    if manifest.dtype not in {str(token_dtype(manifest.vocab_size)), "uint32"}:
        raise ValueError(f"dtype {manifest.dtype} cannot hold vocab_size {manifest.vocab_size}")
    return manifest


def write_manifest(directory: Path, manifest: Manifest) -> None:
    atomic_write(directory / MANIFEST, lambda f: f.write(json.dumps(manifest.to_json(), indent=2).encode() + b"\n"))


def open_shard(directory: Path, info: ShardInfo, dtype: str) -> np.memmap:
    """Memory-map one shard and check it against its manifest entry (catches truncated or swapped files)."""
    path = file_in(directory, info.file, directory / MANIFEST)
    fix = f"delete {directory} and run forge tokenize again"
    if not path.is_file():
        raise DataError(f"shard {path} listed in {directory / MANIFEST} is missing", fix)
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"shard {path} is truncated or not a .npy file ({e})", fix) from None
    if array.dtype != np.dtype(dtype) or array.shape != (info.tokens,):
        raise DataError(
            f"shard {path} holds {array.shape} {array.dtype}; the manifest says ({info.tokens},) {dtype}", fix
        )
    extra = path.stat().st_size - array.offset - array.nbytes
    if extra:
        raise DataError(f"shard {path} has {extra} unexpected trailing bytes", fix)
    return array


class ShardWriter:
    """Collects each document's tokens (ending in EOS) and writes a shard every `shard_tokens` tokens.

    Documents run across shard boundaries, so every shard but the last holds exactly `shard_tokens` tokens.
    Each document carries the caller's position key (increasing). After a shard is written, `on_shard` gets
    the shard and a resume point `(key, done)`: everything before document `key` and the first `done` tokens
    of `key` itself are on disk.
    """

    def __init__(
        self,
        directory: Path,
        dtype: np.dtype,
        shard_tokens: int,
        first_index: int = 0,
        on_shard: Callable[[ShardInfo, Any, int], None] | None = None,
    ) -> None:
        assert shard_tokens > 0
        self.directory, self.dtype, self.shard_tokens = directory, dtype, shard_tokens
        self.index = first_index
        self.on_shard = on_shard
        self.written: list[ShardInfo] = []
        self._pending: deque[tuple[Any, np.ndarray, int]] = deque()  # (key, tokens, tokens of it already written)
        self._pending_tokens = 0
        self._last_finished: tuple[Any, int] = (None, 0)

    def add(self, key: Any, tokens: np.ndarray, already_written: int = 0) -> None:
        """Queue one document's remaining tokens; `already_written` counts its tokens in earlier shards."""
        self._pending.append((key, tokens, already_written))
        self._pending_tokens += len(tokens)
        while self._pending_tokens >= self.shard_tokens:
            self._write(self.shard_tokens)

    def close(self) -> None:
        if self._pending_tokens:
            self._write(self._pending_tokens)

    def _write(self, count: int) -> None:
        taken, documents = [], 0
        while count:
            key, tokens, done = self._pending[0]
            n = min(count, len(tokens))
            taken.append(tokens[:n])
            count -= n
            if n == len(tokens):
                self._pending.popleft()
                self._last_finished = (key, done + n)
                documents += 1
            else:
                self._pending[0] = (key, tokens[n:], done + n)
        shard = np.concatenate(taken)
        self._pending_tokens -= len(shard)
        info = ShardInfo(shard_name(self.index), len(shard), documents)
        atomic_write(self.directory / info.file, lambda f: np.save(f, shard, allow_pickle=False))
        self.index += 1
        self.written.append(info)
        if self.on_shard is not None:
            key, done = (self._pending[0][0], self._pending[0][2]) if self._pending else self._last_finished
            self.on_shard(info, key, done)
