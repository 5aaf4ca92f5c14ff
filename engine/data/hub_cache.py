"""Hugging Face datasets named in the config (`data.hf_dataset_name`, `eval.hf_dataset_name`), tokenized once
into the Forge cache and then read like any shards.

Training reads token shards, so that the sample order is a pure function of the step and a resumed run is
exact; a dataset named in the config therefore goes through `forge tokenize`'s machinery first. The entry is
`$FORGE_CACHE_DIR/hf/<digest>/`, the digest being tokenize's run key: the dataset's name, configuration,
split and fingerprint, the text column and the tokenizer's bytes. A changed dataset or tokenizer makes a new
entry. Every rank asks for the entry; a record lock on `<digest>.lock` lets one build it while the others
wait, and an interrupted build (a preempted job) resumes where it stopped on the next attempt.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from pathlib import Path
from typing import Iterator

from engine.data import DEFAULT_SHARD_TOKENS
from engine.data.embedded import cache_dir
from engine.data.hub import HubSource
from engine.data.shards import MANIFEST
from engine.data.tokenize import run_key, tokenize
from engine.data.tokenizer import Encoder
from engine.errors import DataError

log = logging.getLogger("forge.data")


def hub_shards(name: str, config: str | None, split: str, streaming: bool, text_field: str, tokenizer: Path,
               field: str) -> Path:
    """The cache directory holding `name`'s split tokenized with `tokenizer`, built on first use. `field`
    names the config field the dataset came from, for errors."""
    if not tokenizer.is_file():
        raise DataError(f"{field} needs a tokenizer: {tokenizer} not found", "set data.tokenizer_path to a tokenizer.json")
    source = HubSource(name, config, split, streaming)
    encoder = Encoder.from_file(tokenizer, None)
    source.check(text_field)
    entry = cache_dir() / "hf" / run_key(source, text_field, DEFAULT_SHARD_TOKENS, encoder, None, None)[:16]
    if (entry / MANIFEST).is_file():
        return entry
    with locked(entry.parent / f"{entry.name}.lock"):
        if not (entry / MANIFEST).is_file():  # another rank may have built it while this one waited
            log.info("tokenizing %s into %s (once; later runs reuse it)", source, entry)
            tokenize(source, entry, tokenizer=tokenizer, text_field=text_field)
    return entry


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive record lock on `path` (waiting for it). Building without one could let two ranks
    write the same directory, so a file system that cannot lock is an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise DataError(f"cannot write the Forge cache {path.parent} ({e.strerror})",
                        "set FORGE_CACHE_DIR to a writable directory") from None
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            raise DataError(f"the Forge cache {path.parent} is on a file system without locks",
                            "set FORGE_CACHE_DIR to a local directory, or tokenize the dataset first "
                            "(forge tokenize hf:NAME …) and set data.dataset_path") from None
        yield
    finally:
        os.close(fd)  # closing releases the lock
