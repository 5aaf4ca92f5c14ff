"""The default training data: Shakespeare's works, shipped in the package and tokenized once into a cache.

`engine/data/corpus/shakespeare.jsonl.gz` holds one work per line (see corpus/SOURCE.md). The first use
trains a byte-level BPE tokenizer (vocab 4096) on the training works and tokenizes them, plus a held-out
split of two works for evaluation and the training works split into plays and poems (two sources for
mixtures), into `$FORGE_CACHE_DIR/corpus/shakespeare-<digest>/{train,val,plays,poems}` (default
cache `~/.cache/forge`). The digest covers the corpus bytes and this recipe, so a change to either builds a
new entry. Builders work in a private temporary directory and publish it with one atomic rename, so
concurrent builders (e.g. every rank of a job) and killed ones can never leave a half-built entry.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from engine.data.shards import FORMAT_VERSION
from engine.data.tokenize import write_encoded
from engine.data.tokenizer import DEFAULT_EOS, Encoder
from engine.errors import DataError
from engine.safe_paths import cache_path

CORPUS = Path(__file__).with_name("corpus") / "shakespeare.jsonl.gz"
HELD_OUT = ("Hamlet", "The Tempest")  # titles of the validation split
# The training works split in two disjoint parts, for mixtures ([[data.datasets]] embedded = "plays" | "poems").
POEMS = (
    "Sonnets",
    "The Rape of Lucrece",
    "A Lover's Complaint",
    "The Passionate Pilgrim",
    "The Phoenix and the Turtle",
)
SPLITS = ("train", "val", "plays", "poems")  # the tokenized folders of a build (val: the held-out works)
VOCAB_SIZE = 4096
RECIPE = {
    "version": 1,
    "format": FORMAT_VERSION,
    "vocab_size": VOCAB_SIZE,
    "eos": DEFAULT_EOS,
    "held_out": HELD_OUT,
    "poems": POEMS,
}
STALE_BUILD_SECONDS = 600  # a build takes seconds; a temporary directory this old belongs to a dead builder


@dataclass(frozen=True)
class EmbeddedCorpus:
    train: Path
    val: Path

    def split(self, name: str) -> Path:
        """train, val, or a part of train: plays, poems (all tokenized with the same tokenizer)."""
        return self.train.parent / name


def cache_dir() -> Path:
    return Path(os.environ.get("FORGE_CACHE_DIR") or Path.home() / ".cache" / "forge")


def cache_entry(kind: str, name: str) -> Path:
    """`$FORGE_CACHE_DIR/kind/name`, refused (naming it) where either is a symbolic link: every cache writes,
    replaces and deletes files in its entries, never in a link's target (`engine.safe_paths.cache_path`)."""
    return cache_path(cache_dir(), kind, name)


def embedded_corpus() -> EmbeddedCorpus:
    """The tokenized train/val directories of the embedded corpus, built on first use."""
    digest = hashlib.sha256(CORPUS.read_bytes() + json.dumps(RECIPE).encode()).hexdigest()
    entry = cache_entry("corpus", f"shakespeare-{digest[:16]}")
    if not entry.is_dir():
        build(entry)
    return EmbeddedCorpus(entry / "train", entry / "val")


def build(entry: Path) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    except OSError as e:
        raise DataError(
            f"cannot write the Forge cache {entry.parent} ({e.strerror})", "set FORGE_CACHE_DIR to a writable directory"
        ) from None
    remove_stale_builds(entry.parent, keep=tmp)
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the published entry should read like any cache file
        write_splits(tmp)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not entry.is_dir():  # only a concurrent builder that finished first is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_splits(tmp: Path) -> None:
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        works = [json.loads(line) for line in f]
    assert set(HELD_OUT) <= {w["title"] for w in works}, "held-out titles missing from the corpus"
    assert set(POEMS) <= {w["title"] for w in works}, "poem titles missing from the corpus"
    train = [w for w in works if w["title"] not in HELD_OUT]
    val = [w for w in works if w["title"] in HELD_OUT]
    plays = [w for w in train if w["title"] not in POEMS]
    poems = [w for w in train if w["title"] in POEMS]
    encoder = Encoder.trained((w["text"] for w in train), VOCAB_SIZE)
    # Each work is encoded once (a work's tokens do not depend on the others), then written into its splits.
    ids = dict(zip((w["title"] for w in works), encoder.encode([w["text"] for w in works])))
    for split, chosen in zip(SPLITS, (train, val, plays, poems), strict=True):
        source = {"corpus": CORPUS.name, "split": split, "works": [w["title"] for w in chosen]}
        write_encoded([ids[w["title"]] for w in chosen], tmp / split, encoder, source)


def remove_stale_builds(root: Path, keep: Path) -> None:
    for path in root.glob(".shakespeare-*"):
        try:
            stale = path != keep and time.time() - path.stat().st_mtime > STALE_BUILD_SECONDS
        except FileNotFoundError:  # another builder just published or removed it
            continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)
