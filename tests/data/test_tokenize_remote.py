"""`forge tokenize` from URLs through fsspec: fsspec's `memory://` store and an HTTP server on 127.0.0.1 give the
tokens the same files give locally; a store that keeps failing exits 2 naming the URL with only whole files
left, and the rerun resumes; an interrupted remote run resumes to the uninterrupted output."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
from typer.testing import CliRunner

from engine.data.shards import read_manifest
from engine.data.tokenize import STATE, tokenize_files
from forgecli.app import app
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
from tests.helpers.remote import Store
from tests.helpers.remote import server as server  # a fixture

TEXTS = corpus_texts()


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr("engine.data.remote.FIRST_WAIT", 0.01)


@pytest.fixture
def tok(tmp_path: Path) -> Path:
    return tokenizer_file(tmp_path / "tok")


def local_inputs(root: Path) -> list[Path]:
    return [
        write_jsonl(root / "a.jsonl", TEXTS[:5]),
        write_parquet(root / "b.parquet", TEXTS[5:10], row_group_size=2),
        write_txt(root / "c", TEXTS[10:]) / "doc000.txt",
    ]


def forge(*args: str | Path) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["tokenize", *map(str, args)], env={"NO_COLOR": "1", "COLUMNS": "300"})
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, " ".join(result.output.split())


def test_memory_store_folder_gives_the_local_tokens(tmp_path: Path, tok: Path):
    files = local_inputs(tmp_path / "in")
    root = f"memory://forge-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    for path in files:
        fs.pipe(f"{root}/corpus/{path.name}", path.read_bytes())
    fs.pipe(f"{root}/corpus/.hidden/x.jsonl", b'{"text": "not read"}\n')
    local = tokenize_files(files, tmp_path / "local", tokenizer=tok, shard_tokens=700)
    remote = tokenize_files([f"{root}/corpus"], tmp_path / "remote", tokenizer=tok, shard_tokens=700)
    assert remote.manifest.source["inputs"] == [f"{root}/corpus/{p.name}" for p in files]
    assert (remote.manifest.total_documents, remote.manifest.total_tokens) == (
        local.manifest.total_documents,
        local.manifest.total_tokens,
    )
    assert np.array_equal(all_tokens(tmp_path / "remote"), all_tokens(tmp_path / "local"))


def test_http_inputs_give_the_local_tokens_through_failures_and_keep_credentials_out(
    tmp_path: Path, tok: Path, server: str
):
    files = local_inputs(tmp_path / "in")
    for path in files:
        Store.files[f"/{path.name}"] = path.read_bytes()
    Store.flaky = {"/a.jsonl": 2, "/b.parquet": 3}  # each read is retried until the store answers
    urls = [f"{server.replace('http://', 'http://user:secret@')}/{p.name}?sig=secret" for p in files]
    code, output = forge(*urls, "--tokenizer", tok, "--shard-tokens", "700", "--out", tmp_path / "remote")
    assert code == 0, output
    local = tokenize_files(files, tmp_path / "local", tokenizer=tok, shard_tokens=700)
    assert np.array_equal(all_tokens(tmp_path / "remote"), all_tokens(tmp_path / "local"))
    written = "".join(p.read_text() for p in (tmp_path / "remote").glob("*.json")) + output
    assert "secret" not in written and f"{server}/a.jsonl" in written
    assert read_manifest(tmp_path / "remote").total_documents == local.manifest.total_documents == 11
    assert Store.gets["/a.jsonl"] > 2 and Store.gets["/b.parquet"] > 3


def test_a_store_that_keeps_failing_exits_2_naming_the_url_and_the_rerun_resumes(
    tmp_path: Path, tok: Path, server: str, monkeypatch
):
    monkeypatch.setattr("engine.data.tokenize.BATCH_CHARS", 1)  # shards are written before the failing file
    files = local_inputs(tmp_path / "in")
    for path in files:
        Store.files[f"/{path.name}"] = path.read_bytes()
    Store.failing.add("/doc000.txt")  # the last input: .jsonl and .parquet are tokenized first
    urls = [f"{server}/{p.name}?sig=secret" for p in files]
    out = tmp_path / "out"
    args = [*urls, "--tokenizer", tok, "--shard-tokens", "700", "--out", out]
    code, output = forge(*args)
    assert code == 2 and "secret" not in output, output
    assert f"could not read {server}/doc000.txt: 5 tries failed (last: ClientResponseError, HTTP 503)" in output
    assert Store.gets["/doc000.txt"] == 5
    left = sorted(p.name for p in out.iterdir())
    assert "manifest.json" not in left and STATE in left and not [n for n in left if n.endswith(".tmp")]
    kept = [n for n in left if n.startswith("shard-")]
    assert len(kept) >= 10, left  # the shards of a.jsonl and b.parquet, whole, kept for the rerun
    Store.failing.clear()
    code, output = forge(*args, "--json")
    assert code == 0, output
    assert int(re.search(r'"reused_shards": (\d+)', output)[1]) >= 10
    local = tokenize_files(files, tmp_path / "local", tokenizer=tok, shard_tokens=700)
    for path in local.directory.iterdir():
        if path.name != "manifest.json":
            assert (out / path.name).read_bytes() == path.read_bytes(), path.name


def test_an_interrupted_remote_run_resumes_to_the_uninterrupted_output(
    tmp_path: Path, tok: Path, server: str, monkeypatch
):
    monkeypatch.setattr("engine.data.tokenize.BATCH_CHARS", 1)
    files = local_inputs(tmp_path / "in")
    for path in files:
        Store.files[f"/{path.name}"] = path.read_bytes()
    urls = [f"{server}/{p.name}" for p in files]
    clean = tokenize_files(urls, tmp_path / "clean", tokenizer=tok, shard_tokens=600)
    out = tmp_path / "out"
    with pytest.raises(Interrupt):
        tokenize_files(urls, out, tokenizer=tok, shard_tokens=600, progress=interrupt_after(17))  # in the .parquet
    resumed = tokenize_files(urls, out, tokenizer=tok, shard_tokens=600)
    assert 17 <= resumed.reused_shards < len(clean.manifest.shards)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in clean.directory.iterdir())
    for path in clean.directory.iterdir():
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name


def test_bad_urls_exit_2_naming_them(tmp_path: Path, tok: Path, server: str):
    Store.files["/a.csv"] = b"x"
    cases = {
        f"{server}/missing.jsonl": f"input {server}/missing.jsonl not found",
        f"{server}/a.csv": f"input {server}/a.csv has an unknown extension '.csv'",
        "nosuchscheme://bucket/a.jsonl": "nosuchscheme://bucket/a.jsonl",
        "http://127.0.0.1:9/a.jsonl": "could not read http://127.0.0.1:9/a.jsonl: 5 tries failed",
    }
    for url, message in cases.items():
        code, output = forge(url, "--tokenizer", tok, "--out", tmp_path / "out")
        assert code == 2 and message in output, output
        assert not (tmp_path / "out").exists()
