"""The embedded Shakespeare corpus: tokenized once into the cache, reused, and safe against racing builders."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from engine.data import embedded
from engine.data.embedded import CORPUS, HELD_OUT, embedded_corpus
from engine.data.loader import open_eval_data, open_train_data
from engine.data.shards import read_manifest
from engine.errors import DataError
from tests.helpers.data_fixtures import job_config


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_corpus_file_is_small_and_holds_whole_works():
    assert CORPUS.stat().st_size < 3_000_000
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        works = [json.loads(line) for line in f]
    assert len(works) == 42 and {"Hamlet", "Sonnets", "The Tempest"} <= {w["title"] for w in works}
    assert not any("Gutenberg" in w["text"] for w in works)
    assert (CORPUS.parent / "SOURCE.md").is_file()


def test_training_uses_the_embedded_corpus_built_once(cache: Path, monkeypatch: pytest.MonkeyPatch):
    cfg = job_config(None, "eval.enabled=true", "model.vocab_size=4096")
    train, evaluation = open_train_data(cfg), open_eval_data(cfg)
    assert train.manifest.vocab_size == 4096 and train.manifest.dtype == "uint16"
    assert evaluation.manifest.source["works"] == list(HELD_OUT)
    assert not set(HELD_OUT) & set(train.manifest.source["works"])
    assert train.manifest.tokenizer_sha256 == evaluation.manifest.tokenizer_sha256
    assert train.tokenizer_file == train.directory / "tokenizer.json"
    assert train.manifest.total_tokens > 1_000_000 and train.manifest.total_documents == 40
    x, _y = next(train.batches())
    assert x.shape == (4, 16) and int(x.max()) < 4096
    assert [p.name for p in (cache / "corpus").iterdir()] == [train.directory.parent.name]

    def no_rebuild(entry: Path) -> None:
        raise AssertionError("the cached corpus was rebuilt")

    monkeypatch.setattr(embedded, "build", no_rebuild)
    assert open_train_data(cfg).manifest == train.manifest


def test_a_builder_that_loses_the_race_keeps_the_winners_entry(cache: Path):
    corpus = embedded_corpus()
    entry = corpus.train.parent
    stale = entry.parent / f".{entry.name}.dead-builder"
    stale.mkdir()
    os.utime(stale, (0, 0))
    before = read_manifest(corpus.train)
    embedded.build(entry)  # a second builder finishing after the first one published
    assert read_manifest(corpus.train) == before
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # its temporary and the stale one are gone


def test_unwritable_cache_is_a_data_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("FORGE_CACHE_DIR", str(blocker))
    with pytest.raises(DataError, match="cannot write the Forge cache") as err:
        embedded_corpus()
    assert "FORGE_CACHE_DIR" in err.value.hint


def test_a_config_that_does_not_fit_the_corpus_keeps_its_own_fix_and_a_damaged_cache_is_rebuilt(cache: Path):
    """Deleting the cache is the fix for a damaged cache only: a model.vocab_size below the corpus's says to
    raise it (a rebuilt cache would be refused the same way), never to delete a folder Forge manages."""
    with pytest.raises(DataError, match=r"more than model\.vocab_size = 1000") as small:
        open_train_data(job_config(None, "model.vocab_size=1000"))
    assert small.value.hint == "set model.vocab_size to at least 4096" and str(cache) not in small.value.hint

    corpus = embedded_corpus()
    shard = corpus.train / read_manifest(corpus.train).shards[0].file
    shard.write_bytes(shard.read_bytes()[:-2])  # truncated, as a full disk or a killed copy leaves it
    with pytest.raises(DataError, match=r"truncated|holds") as damaged:
        open_train_data(job_config(None, "model.vocab_size=4096"))
    assert damaged.value.hint.startswith(f"delete {corpus.train.parent} (the embedded corpus cache)")
