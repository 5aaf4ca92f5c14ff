"""Tokenizing files into shards: formats, EOS placement, manifest, dtype, reruns and resuming."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from engine.data.shards import read_manifest, token_dtype
from engine.data.tokenize import STATE, tokenize_files
from engine.data.tokenizer import Encoder
from engine.errors import DataError
from tests.conftest import REPO
from tests.helpers.data_fixtures import (
    Interrupt,
    all_tokens,
    corpus_texts,
    interrupt_after,
    tokenizer_file,
    write_jsonl,
    write_parquet,
    write_txt,
)

TEXTS = corpus_texts()


@pytest.fixture
def tok(tmp_path: Path) -> Path:
    return tokenizer_file(tmp_path / "tok")


def test_txt_jsonl_parquet_give_the_same_tokens(tmp_path: Path, tok: Path):
    sources = {
        "jsonl": write_jsonl(tmp_path / "a.jsonl", TEXTS),
        "txt": write_txt(tmp_path / "txt", TEXTS),
        "parquet": write_parquet(tmp_path / "a.parquet", TEXTS),
    }
    results = {}
    for kind, source in sources.items():
        report = tokenize_files([source], tmp_path / f"out-{kind}", tokenizer=tok, shard_tokens=700)
        results[kind] = all_tokens(report.directory)
        assert report.manifest.total_documents == len(TEXTS)
    assert np.array_equal(results["jsonl"], results["txt"]) and np.array_equal(results["jsonl"], results["parquet"])


def test_directories_are_searched_recursively(tmp_path: Path, tok: Path):
    root = tmp_path / "in"
    write_jsonl(root / "b" / "part.jsonl", TEXTS[:4])
    write_parquet(root / "a" / "deep" / "part.parquet", TEXTS[4:7])
    write_txt(root / "c", TEXTS[7:9])
    write_txt(root / ".hidden", TEXTS[9:])  # skipped, as are files of other types
    (root / "notes.md").write_text("not a document")
    report = tokenize_files([root], tmp_path / "out", tokenizer=tok)
    assert report.manifest.total_documents == 9
    assert [Path(p).parent.name for p in report.manifest.source["inputs"]] == ["deep", "b", "c", "c"]


def test_eos_follows_every_document_and_decodes_back(tmp_path: Path, tok: Path):
    texts = [*TEXTS[:5], "a document that mentions <|endoftext|> as plain text"]
    report = tokenize_files(
        [write_jsonl(tmp_path / "a.jsonl", texts)], tmp_path / "out", tokenizer=tok, shard_tokens=500
    )
    tokens, eos = all_tokens(report.directory), report.manifest.eos_id
    assert tokens[-1] == eos and np.count_nonzero(tokens == eos) == len(texts)
    decoder = Tokenizer.from_file(str(tok))
    pieces = np.split(tokens, np.flatnonzero(tokens == eos) + 1)[:-1]
    assert [decoder.decode(p[:-1].tolist()) for p in pieces] == texts


def test_manifest_describes_the_shards(tmp_path: Path, tok: Path):
    report = tokenize_files(
        [write_jsonl(tmp_path / "a.jsonl", TEXTS)], tmp_path / "out", tokenizer=tok, shard_tokens=1000
    )
    out, m = report.directory, report.manifest
    raw = json.loads((out / "manifest.json").read_text())
    assert raw["format"] == "forge-token-shards" and raw["version"] == 1 and raw["dtype"] == "uint16"
    assert raw["tokenizer"] == {
        "sha256": hashlib.sha256(tok.read_bytes()).hexdigest(),
        "vocab_size": 400,
        "eos_id": 0,
        "eos_token": "<|endoftext|>",
    }
    assert (out / "tokenizer.json").read_bytes() == tok.read_bytes()
    sizes = [np.load(out / s["file"]).size for s in raw["shards"]]
    assert sizes == [s["tokens"] for s in raw["shards"]] and set(sizes[:-1]) == {1000} and 0 < sizes[-1] <= 1000
    assert raw["total_tokens"] == sum(sizes) and raw["total_documents"] == len(TEXTS)
    assert sum(s["documents"] for s in raw["shards"]) == len(TEXTS)
    eos_per_shard = [int(np.count_nonzero(np.load(out / s.file) == m.eos_id)) for s in m.shards]
    assert eos_per_shard == [s.documents for s in m.shards]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", *[s.file for s in m.shards], "tokenizer.json"]


def test_dtype_is_uint16_up_to_65536_tokens_then_uint32(tmp_path: Path):
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, 70_000)}}
    big = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    big.pre_tokenizer = pre_tokenizers.Whitespace()
    big.save(str(tmp_path / "big.json"))
    report = tokenize_files(
        [write_jsonl(tmp_path / "a.jsonl", ["w69999 w5 w70000"])], tmp_path / "out", tokenizer=tmp_path / "big.json"
    )
    assert report.manifest.dtype == "uint32" and report.manifest.vocab_size == 70_000
    assert all_tokens(report.directory).tolist() == [69999, 5, 1, 0]


def test_eos_token_is_found_or_must_be_named(tmp_path: Path):
    def save(vocab: dict[str, int], name: str) -> Path:
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="x"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        path = tmp_path / name / "tokenizer.json"
        path.parent.mkdir()
        tokenizer.save(str(path))
        return path

    llama_like = save({"x": 0, "<s>": 1, "</s>": 2}, "llama")
    assert Encoder.from_file(llama_like).eos_id == 2
    custom = save({"x": 0, "<end>": 1, "</s>": 2}, "custom")
    (custom.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<end>"}}))
    assert Encoder.from_file(custom).eos_id == 1
    assert Encoder.from_file(custom, eos_token="</s>").eos_id == 2
    nameless = save({"x": 0, "<stop>": 1}, "nameless")
    with pytest.raises(DataError, match="cannot tell which token") as err:
        Encoder.from_file(nameless)
    assert "--eos-token" in err.value.hint
    with pytest.raises(DataError, match="'<nope>' is not in the vocabulary"):
        Encoder.from_file(nameless, eos_token="<nope>")


def test_trained_tokenizer_is_deterministic_across_processes(tmp_path: Path):
    code = (
        "import sys; from tests.helpers.data_fixtures import corpus_texts; from engine.data.tokenizer import Encoder;"
        "sys.stdout.write(Encoder.trained(corpus_texts(), 400).sha256)"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    assert other.stdout == Encoder.trained(TEXTS, 400).sha256 == Encoder.trained(TEXTS, 400).sha256


def test_trained_tokenizer_is_saved_beside_the_shards(tmp_path: Path):
    report = tokenize_files([write_jsonl(tmp_path / "a.jsonl", TEXTS)], tmp_path / "out", train_vocab_size=300)
    saved = report.directory / "tokenizer.json"
    assert hashlib.sha256(saved.read_bytes()).hexdigest() == report.manifest.tokenizer_sha256
    assert Tokenizer.from_file(str(saved)).get_vocab_size() == report.manifest.vocab_size == 300


def mixed_inputs(root: Path) -> Path:
    """Several files of every kind, so resume points fall inside .jsonl and .parquet files and between .txt."""
    write_jsonl(root / "a.jsonl", TEXTS[:5])
    write_parquet(root / "b.parquet", TEXTS[5:10], row_group_size=2)
    write_txt(root / "c", TEXTS[10:])
    return root


@pytest.mark.parametrize("stop_after", [2, 17, 27])  # inside the .jsonl, the .parquet, the .txt files
@pytest.mark.parametrize("tokenizer", ["file", "train"])
def test_interrupted_run_resumes_to_identical_output(
    tmp_path: Path, tok: Path, monkeypatch: pytest.MonkeyPatch, stop_after: int, tokenizer: str
):
    monkeypatch.setattr("engine.data.tokenize.BATCH_CHARS", 1)  # one document per batch: stop between any two
    source = mixed_inputs(tmp_path / "in")
    options = {"tokenizer": tok} if tokenizer == "file" else {"train_vocab_size": 350}
    clean = tokenize_files([source], tmp_path / "clean", shard_tokens=600, **options)
    out = tmp_path / "out"
    with pytest.raises(Interrupt):
        tokenize_files([source], out, shard_tokens=600, progress=interrupt_after(stop_after), **options)
    recorded = len(json.loads((out / STATE).read_text())["shards"])
    assert recorded >= stop_after and not (out / "manifest.json").exists()
    # What a kill can leave: a half-written temporary file, and a shard moved into place but not yet recorded.
    (out / "shard-00099.npy.1234.tmp").write_bytes(b"half a shard")
    (out / f"shard-{recorded:05d}.npy").write_bytes(b"unrecorded")
    resumed = tokenize_files([source], out, shard_tokens=600, **options)
    assert resumed.reused_shards == recorded < len(clean.manifest.shards)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in clean.directory.iterdir())
    for path in clean.directory.iterdir():
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name


def test_changed_inputs_restart_cleanly(tmp_path: Path, tok: Path):
    source = write_jsonl(tmp_path / "in" / "a.jsonl", TEXTS)
    with pytest.raises(Interrupt):
        tokenize_files([source], tmp_path / "out", tokenizer=tok, shard_tokens=600, progress=interrupt_after(2))
    write_jsonl(source, TEXTS[::-1])
    report = tokenize_files([source], tmp_path / "out", tokenizer=tok, shard_tokens=600)
    fresh = tokenize_files([source], tmp_path / "fresh", tokenizer=tok, shard_tokens=600)
    assert report.reused_shards == 0
    assert np.array_equal(all_tokens(report.directory), all_tokens(fresh.directory))
    assert len(list(report.directory.iterdir())) == len(list(fresh.directory.iterdir()))


def test_rerun_of_a_finished_output(tmp_path: Path, tok: Path):
    source = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    first = tokenize_files([source], tmp_path / "out", tokenizer=tok)
    again = tokenize_files([source], tmp_path / "out", tokenizer=tok)
    assert again.already_complete and again.manifest == first.manifest
    with pytest.raises(DataError, match="already holds a data set tokenized from other inputs"):
        tokenize_files([source], tmp_path / "out", tokenizer=tok, shard_tokens=77)
    assert read_manifest(tmp_path / "out") == first.manifest


def test_a_bad_record_late_in_the_input_leaves_nothing_behind(tmp_path: Path, tok: Path):
    source = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    with open(source, "a") as f:
        f.write(json.dumps({"body": "no text field"}) + "\n")
    (tmp_path / "existing").mkdir()
    for out in (tmp_path / "new", tmp_path / "existing"):
        with pytest.raises(DataError, match=r"a\.jsonl line 13 has no field 'text'"):
            tokenize_files([source], out, tokenizer=tok, shard_tokens=500)
    assert not (tmp_path / "new").exists() and not any((tmp_path / "existing").iterdir())


def test_refuses_to_write_into_a_directory_with_other_files(tmp_path: Path, tok: Path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="did not write"):
        tokenize_files([write_jsonl(tmp_path / "a.jsonl", TEXTS)], tmp_path / "out", tokenizer=tok)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]


def test_input_kinds_are_a_registry_open_source_looks_up(tmp_path: Path, tok: Path):
    """A kind registered under a scheme opens `SCHEME:NAME` inputs (with the dataset options); `hf:` is one such
    kind, and `SCHEME://` URLs and plain paths are files."""
    from engine.config.base import Section
    from engine.config.registry import SOURCE_KINDS
    from engine.data import tokenize as tokenize_module
    from engine.data.sources import FileSource

    opened = []

    def open_lines(name: str, options) -> FileSource:
        opened.append((name, options.split))
        return FileSource([write_jsonl(tmp_path / f"{name}.jsonl", TEXTS[:2])])

    with SOURCE_KINDS.restored():  # the kind is gone after the test
        SOURCE_KINDS.register(
            "lines",
            directory=lambda spec, cfg, tokenizer: tmp_path,
            describe="a lines input",
            example="lines:x",
            prefixed=True,
            documents=open_lines,
            flags=("--split",),
        )(Section)
        source = tokenize_module.open_source(["lines:corpus"], split="train")
        assert opened == [("corpus", "train")] and source.describe() == [str(tmp_path / "corpus.jsonl")]
        assert tokenize_module.kind_of("hf:some/dataset").name == "hf"
        assert tokenize_module.kind_of("hf://datasets/some/dataset") is None  # fsspec's URL: files
        assert tokenize_module.kind_of(str(tmp_path / "a.jsonl")) is None
        with pytest.raises(DataError, match="must be the only input"):
            tokenize_module.open_source(["lines:corpus", str(tmp_path / "corpus.jsonl")])
