"""The tokens an extraction runs over, from the same sources as training, cut into windows.

Token shards from `forge tokenize` are memory-mapped (the way to extract over a corpus larger than memory),
as are the embedded corpus's splits (`embedded:val`: its held-out works, wherever the cache keeps them);
text, JSONL or Parquet files and `hf:NAME` datasets are tokenized here with the run's tokenizer, up to
`--max-tokens`; `--text` is one document. Documents are joined the way training joins them (each ends in the
end-of-text token), so a window sees the same kind of context the model was trained on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.config import JobConfig
from engine.data.shards import MANIFEST, open_shard, read_manifest
from engine.data.source_kinds import parse_source, source_directory
from engine.data.tokenize import open_source
from engine.data.tokenizer import Encoder
from engine.errors import DataError, UserError

TEXT_FIELD = "text"
ENCODE_BATCH = 256  # documents encoded per call (the tokenizer spreads a batch over the cores)


@dataclass(frozen=True)
class TokenStream:
    """Token ids as consecutive memory-mapped or in-memory pieces, read by global position."""

    pieces: Sequence[np.ndarray]
    identity: dict = field(default_factory=dict)  # what the tokens came from, for resumable reruns
    starts: tuple[int, ...] = ()

    @classmethod
    def of(cls, pieces: Sequence[np.ndarray], identity: dict, limit: int | None) -> TokenStream:
        kept, total = [], 0
        for piece in pieces:
            cut = piece if limit is None else piece[: max(0, limit - total)]
            if len(cut):
                kept.append(cut)
                total += len(cut)
        starts = tuple(int(x) for x in np.cumsum([0, *(len(p) for p in kept)]))
        return cls(kept, identity, starts)

    def __len__(self) -> int:
        return self.starts[-1] if self.starts else 0

    def read(self, start: int, end: int) -> np.ndarray:
        """Tokens [start, end) as int64."""
        out = np.empty(end - start, dtype=np.int64)
        for piece, offset in zip(self.pieces, self.starts):
            lo, hi = max(start, offset), min(end, offset + len(piece))
            if lo < hi:
                out[lo - start : hi - start] = piece[lo - offset : hi - offset]
        return out


def open_tokens(
    encoder: Encoder, data: str | None, text: str | None, max_tokens: int | None, text_field: str = TEXT_FIELD
) -> TokenStream:
    """The tokens of `--data` (a token-shard folder, `embedded:SPLIT`, files, `hf:NAME`) or `--text`; an empty
    result is an error."""
    if (data is None) == (text is None):
        raise UserError("pass exactly one of --data and --text", "e.g. --data data/tiny or --text 'ROMEO:'")
    if max_tokens is not None and max_tokens < 1:
        raise UserError(f"--max-tokens {max_tokens} must be at least 1", "leave it out to use all the data")
    if text is not None:
        ids = np.array([encoder.eos_id, *encoder.tokenizer.encode(text, add_special_tokens=False).ids], np.int64)
        stream = TokenStream.of([ids], {"text": text}, max_tokens)
        what = "--text"
    else:
        stream = data_tokens(encoder, data, max_tokens, text_field)
        what = f"--data {data}"
    if len(stream) == 0:
        raise DataError(f"{what} holds no tokens", "pass a non-empty data set or text")
    return stream


def data_tokens(encoder: Encoder, data: str, max_tokens: int | None, text_field: str) -> TokenStream:
    """`--data`, spelled as a config's path field is (engine.data.source_kinds.parse_source): token shards
    (a folder, a URL, `embedded:SPLIT`) are memory-mapped, anything else (files, `hf:NAME`) is tokenized here."""
    spec = parse_source(data, "--data")
    if spec.kind == "shards" and not (Path(data) / MANIFEST).is_file():
        return file_tokens(data, encoder, max_tokens, text_field)  # text, JSONL or Parquet files
    if spec.kind == "hf" or (spec.kind == "remote" and not remote_shards(data)):
        return file_tokens(data, encoder, max_tokens, text_field)
    return shard_tokens(source_directory(JobConfig(), spec, built_by_none), encoder, max_tokens, f"--data {data}")


def built_by_none() -> Path:
    raise AssertionError("a kind --data memory-maps (shards, embedded, remote) tokenizes nothing")


def remote_shards(url: str) -> bool:
    """Whether a URL names a `forge tokenize` output (a folder with a manifest) rather than text files."""
    from engine.data.remote import filesystem, retried

    fs, root = filesystem(url)
    return bool(retried(url, lambda: fs.exists(root.rstrip("/") + "/" + MANIFEST)))


def shard_tokens(folder: Path, encoder: Encoder, max_tokens: int | None, named: str) -> TokenStream:
    """A `forge tokenize` output, memory-mapped; its tokenizer must be the run's (other ids mean other words).
    The fix for another tokenizer's shards names a new folder: `folder` may be one Forge manages (the
    embedded corpus's cache, a fetched copy) that other runs read, and tokenizing over it would change theirs."""
    manifest = read_manifest(folder)
    if manifest.tokenizer_sha256 != encoder.sha256:
        shown = named if named.endswith(str(folder)) else f"{named} ({folder})"
        raise DataError(
            f"{shown} was tokenized with another tokenizer (sha256 {manifest.tokenizer_sha256[:12]}…) than the "
            f"model's ({encoder.sha256[:12]}…)",
            "pass held-out text of the model's own data: files (--data FILE…: text, JSONL or Parquet, tokenized "
            "here with the model's tokenizer), or shards made with it in a new folder (forge tokenize INPUT… "
            "--tokenizer RUN/tokenizer.json --out NEW_DIR, then --data NEW_DIR)",
        )
    pieces = [open_shard(folder, info, manifest.dtype) for info in manifest.shards]
    digest = hashlib.sha256((folder / MANIFEST).read_bytes()).hexdigest()
    return TokenStream.of(pieces, {"shards": str(folder.resolve()), "manifest_sha256": digest}, max_tokens)


def file_tokens(data: str, encoder: Encoder, max_tokens: int | None, text_field: str) -> TokenStream:
    """Files or a dataset tokenized in memory, reading no further than `max_tokens` needs. For data sets too
    large for that, `forge tokenize` them first and pass the shard folder."""
    source = open_source([data])
    source.check(text_field)
    pieces: list[np.ndarray] = []
    total, batch = 0, []
    for doc in source.documents(text_field):
        batch.append(doc.text)
        if len(batch) == ENCODE_BATCH:
            total += add_encoded(pieces, encoder, batch)
            batch = []
            if max_tokens is not None and total >= max_tokens:
                break
    if batch and (max_tokens is None or total < max_tokens):
        add_encoded(pieces, encoder, batch)
    # Forge's shards put the end-of-text token after each document; a window then starts a document after it.
    return TokenStream.of(pieces, {"source": source.identity(), "text_field": text_field}, max_tokens)


def add_encoded(pieces: list[np.ndarray], encoder: Encoder, texts: list[str]) -> int:
    encoded = encoder.encode(texts)
    pieces.extend(encoded)
    return sum(len(e) for e in encoded)
