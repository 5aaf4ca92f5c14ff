"""Small inputs for the data tests: documents cut from the embedded corpus, written as .txt/.jsonl/.parquet."""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from engine.config import JobConfig, load_job_config
from engine.data.embedded import CORPUS
from engine.data.shards import read_manifest
from engine.data.tokenize import tokenize_files
from engine.data.tokenizer import Encoder


@cache
def corpus_texts(count: int = 12, chars: int = 2500) -> tuple[str, ...]:
    """`count` documents of about `chars` characters: the openings of the first works of the corpus."""
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        works = [json.loads(line)["text"] for _, line in zip(range(count), f)]
    return tuple(w[:chars] for w in works)


def write_jsonl(path: Path, texts: Sequence[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts)))
    return path


def write_txt(directory: Path, texts: Sequence[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(texts):
        (directory / f"doc{i:03d}.txt").write_text(text)
    return directory


def write_parquet(path: Path, texts: Sequence[str], field: str = "text", row_group_size: int = 3) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": list(range(len(texts))), field: list(texts)}), path, row_group_size=row_group_size)
    return path


def tokenizer_file(directory: Path, vocab_size: int = 400) -> Path:
    """A byte-level BPE trained on `corpus_texts()`, saved as directory/tokenizer.json."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    path.write_bytes(trained_tokenizer_bytes(vocab_size))
    return path


@cache
def trained_tokenizer_bytes(vocab_size: int) -> bytes:
    return Encoder.trained(corpus_texts(), vocab_size).json_bytes


def tokenized(tmp: Path, texts: Sequence[str] = (), shard_tokens: int = 1000, name: str = "data") -> Path:
    """`texts` (default: corpus_texts()) tokenized with the shared test tokenizer into tmp/name."""
    source = write_jsonl(tmp / f"{name}-input" / "docs.jsonl", texts or corpus_texts())
    out = tmp / name
    tokenize_files([source], out, tokenizer=tokenizer_file(tmp / "tokenizer"), shard_tokens=shard_tokens)
    return out


def all_tokens(directory: Path) -> np.ndarray:
    manifest = read_manifest(directory)
    return np.concatenate([np.load(directory / s.file) for s in manifest.shards])


def job_config(dataset: Path | None, *overrides: str) -> JobConfig:
    base = ["train.seq_len=16", "model.max_seq_len=16", "train.batch_size=4", "model.vocab_size=512"]
    if dataset is not None:
        base.append(f"data.dataset_path={dataset}")
    return load_job_config(None, [*base, *overrides])


class Interrupt(Exception):
    """What a test raises from a tokenize progress callback to stop a run midway, as a kill would."""


def interrupt_after(shards: int):
    """A tokenize progress callback that stops the run once `shards` shards are written."""

    def progress(p) -> None:
        if p.shards >= shards:
            raise Interrupt

    return progress
