"""Hostile input cannot delete, overwrite or run anything (issue 45): each section below is one kind of input
that someone else may have written, given to `forge` as a user would, and what must not happen."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.checkpoint.dcp import COMPLETE, TRAIN_STATE
from engine.checkpoint.verify import CHECKSUMS, file_checksum
from engine.config import load_job_config
from engine.data.embedded import embedded_corpus
from engine.data.loader import open_train_data
from engine.data.remote_shards import fetched_shards
from engine.data.shards import MANIFEST, read_manifest
from engine.safe_paths import UnsafePath
from forgecli.app import app
from tests.conftest import REPO
from tests.helpers.cli import forge
from tests.helpers.data_fixtures import corpus_texts, tokenized, tokenizer_file, write_jsonl
from tests.helpers.remote import Store
from tests.helpers.remote import server as server  # a fixture

# ---- paths read from files ----
# A fetched manifest, a checkpoint's checksums.json and the entries of the Forge cache name files; none of them
# may lead `forge` to read, write or delete anything outside its folder (engine/safe_paths.py).

DEBUG = REPO / "presets" / "debug.toml"
TINY_TRAIN = [
    "--model.dim=32",
    "--model.n_layers=1",
    "--model.n_heads=2",
    "--model.n_kv_heads=1",
    "--train.seq_len=32",
    "--model.max_seq_len=32",
    "--train.batch_size=2",
    "--train.max_steps=2",
    "--eval.enabled=false",
    "--scheduler.warmup_steps=1",
]
PLANTED = b"a file the command must leave alone\n"


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr("engine.data.remote.FIRST_WAIT", 0.01)


@pytest.fixture(scope="module")
def data_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small `forge tokenize` output of a few shards, with its tokenizer beside them."""
    return tokenized(tmp_path_factory.mktemp("hostile-data"), shard_tokens=2000)


def files_under(root: Path, leaving_out: Path) -> dict[str, bytes]:
    """Every file below `root` (but those below `leaving_out`) with its bytes, links as where they lead."""
    return {
        str(p.relative_to(root)): (os.readlink(p).encode() if p.is_symlink() else p.read_bytes())
        for p in sorted(root.rglob("*"))
        if (p.is_file() or p.is_symlink()) and not p.is_relative_to(leaving_out)
    }


def train_on(url: str, tmp_path: Path, cache: Path):
    return CliRunner().invoke(
        app,
        ["train", str(DEBUG), *TINY_TRAIN, f"--data.dataset_path={url}", "--run-dir", str(tmp_path / "run")],
        env={"NO_COLOR": "1", "COLUMNS": "300", "FORGE_CACHE_DIR": str(cache)},
    )


@pytest.mark.parametrize("planted", [True, False], ids=["planted-file", "no-file-there"])
@pytest.mark.parametrize("spelling", ["absolute", "dotdot"])
def test_a_fetched_manifest_naming_a_shard_outside_the_cache_is_refused_touching_nothing(
    tmp_path: Path, data_set: Path, server: str, spelling: str, planted: bool
):
    """Before: the fetch skipped a planted file of that name, found it no shard and deleted it; or wrote the
    server's file outside the cache and trained on it (exit 0)."""
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    if planted:
        (outside / "planted.npy").write_bytes(PLANTED)
    # The entry is cache/remote/<digest>/: three levels up is tmp_path.
    name = str(outside / "planted.npy") if spelling == "absolute" else "../../../outside/planted.npy"
    manifest = json.loads((data_set / MANIFEST).read_text())
    first = manifest["shards"][0]["file"]
    manifest["shards"][0]["file"] = name
    Store.files.update({f"/data/{p.name}": p.read_bytes() for p in data_set.iterdir() if p.is_file()})
    Store.files["/data/manifest.json"] = json.dumps(manifest).encode()
    shard = (data_set / first).read_bytes()  # served under the hostile name too, as a hostile store would
    Store.files.update({f"/data/{name}": shard, os.path.normpath(f"/data/{name}"): shard, name: shard})
    before = files_under(tmp_path, leaving_out=cache)

    result = train_on(f"{server}/data", tmp_path, cache)

    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert f"{server}/data/{MANIFEST} is not a readable manifest" in output, output
    assert f"names {name!r}, which is not a plain file name" in output, output
    assert "Traceback" not in output
    assert files_under(tmp_path, leaving_out=cache) == before  # the planted file intact, nothing new outside
    assert not (tmp_path / "run").exists()
    assert not (cache / "remote").exists()  # refused before the cache is touched


def fake_step(folder: Path, sums: dict[str, str]) -> Path:
    """A checkpoint folder forge eval can resolve (its model.toml and tokenizer beside it) whose one step's
    checksums.json is `sums`: the refusal comes before any weight is read, so it holds no weights."""
    step = folder / "step_1"
    step.mkdir(parents=True)
    shutil.copyfile(DEBUG, folder / "model.toml")
    shutil.copyfile(tokenizer_file(folder / "tok"), folder / "tokenizer.json")
    (step / TRAIN_STATE).write_text(json.dumps({"step": 1}))
    (step / CHECKSUMS).write_text(json.dumps(sums))
    (step / COMPLETE).write_text("")
    return step


@pytest.mark.parametrize("entry", ["/dev/zero", "../../outside/secret", "link-out", "sub/secret"])
def test_a_checksum_list_naming_anything_but_a_file_in_its_folder_is_refused(tmp_path: Path, entry: str):
    """Before: /dev/zero was read for ever (forge checkpoint verify hung); ../../outside/secret and a link out
    of the folder were read and reported as a damaged file (exit 1)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(PLANTED)
    step = fake_step(tmp_path / "ckpt", {entry: file_checksum(outside / "secret")})
    (step / "link-out").symlink_to(outside / "secret")

    result = forge("checkpoint", "verify", str(step), timeout=60)

    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, output
    assert str(step / CHECKSUMS) in output and entry in output, output
    assert "Traceback" not in output


def test_forge_eval_refuses_a_checksum_list_naming_a_device(tmp_path: Path):
    """Before: loading the checkpoint read /dev/zero for ever."""
    step = fake_step(tmp_path / "ckpt", {"/dev/zero": "crc32:00000000"})

    result = forge("eval", str(step), "--data", "embedded:val", timeout=120)

    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, output
    assert f"{step / CHECKSUMS} names '/dev/zero', which is not a plain file name" in output, output
    assert "Traceback" not in output


def fetched_entry(url: str, cache: Path) -> Path:
    """The cache entry of the data set at `url`, fetched (the first fetch says where the entry is)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORGE_CACHE_DIR", str(cache))
        return fetched_shards(url, "data.dataset_path")


def test_a_remote_cache_entry_replaced_by_a_link_is_refused_and_its_target_left_alone(
    tmp_path: Path, data_set: Path, server: str
):
    """Before: the fetch wrote the shards through the link into its target, and deleted its files that
    did not match the manifest."""
    cache, victim = tmp_path / "cache", tmp_path / "victim"
    victim.mkdir()
    Store.files.update({f"/data/{p.name}": p.read_bytes() for p in data_set.iterdir() if p.is_file()})
    (victim / read_manifest(data_set).shards[0].file).write_bytes(PLANTED)  # a shard's name, not that shard
    (victim / "tokenizer.json").write_bytes(PLANTED)
    url = f"{server}/data"
    entry = fetched_entry(url, cache)
    shutil.rmtree(entry)
    entry.symlink_to(victim)
    before = files_under(tmp_path, leaving_out=cache)

    result = train_on(url, tmp_path, cache)

    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert f"the Forge cache entry {entry} is a symbolic link" in output and f"rm {entry};" in output, output
    assert "Traceback" not in output
    assert files_under(tmp_path, leaving_out=cache) == before
    assert not (tmp_path / "run").exists()
    entry.unlink()  # the fix the message gives
    assert fetched_entry(url, cache) == entry and (entry / MANIFEST).is_file() and not entry.is_symlink()


def test_a_cache_lock_replaced_by_a_link_is_refused_and_its_target_never_created(
    tmp_path: Path, data_set: Path, server: str
):
    """Before: opening the lock created the link's target, wherever it pointed."""
    cache = tmp_path / "cache"
    Store.files.update({f"/data/{p.name}": p.read_bytes() for p in data_set.iterdir() if p.is_file()})
    url = f"{server}/data"
    entry = fetched_entry(url, cache)
    shutil.rmtree(entry)
    lock = entry.parent / f"{entry.name}.lock"
    lock.unlink()
    lock.symlink_to(tmp_path / "created-outside")

    result = train_on(url, tmp_path, cache)

    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert f"the Forge cache lock {lock} is a symbolic link" in output, output
    assert not (tmp_path / "created-outside").exists()


def test_the_embedded_corpus_cache_refuses_a_folder_replaced_by_a_link(tmp_path: Path, monkeypatch):
    """Before: the corpus was built into the link's target."""
    cache, victim = tmp_path / "cache", tmp_path / "victim"
    victim.mkdir()
    cache.mkdir()
    (cache / "corpus").symlink_to(victim)
    monkeypatch.setenv("FORGE_CACHE_DIR", str(cache))
    with pytest.raises(UnsafePath, match=f"the Forge cache entry {re.escape(str(cache / 'corpus'))} is a symbolic"):
        embedded_corpus()
    assert not any(victim.iterdir())


def test_a_hub_cache_entry_replaced_by_a_link_is_refused_and_its_target_left_alone(tmp_path: Path, monkeypatch):
    """Before: tokenizing into the entry again deleted every file of the link's target."""
    repo, cache, victim = tmp_path / "repo", tmp_path / "cache", tmp_path / "victim"
    write_jsonl(repo / "data" / "train.jsonl", corpus_texts())
    named = [f"--data.hf_dataset_name={repo}", f"--data.tokenizer_path={tokenizer_file(tmp_path / 'tok')}"]
    overrides = [*TINY_TRAIN, "--model.vocab_size=512", *named]
    with monkeypatch.context() as patch:
        patch.setenv("FORGE_CACHE_DIR", str(cache))
        entry = open_train_data(load_job_config(DEBUG, [o.removeprefix("--") for o in overrides])).directory
    assert entry.parent == cache / "hf"
    shutil.rmtree(entry)
    victim.mkdir()
    (victim / "shard-00000.npy").write_bytes(PLANTED)  # named like a shard: what a rerun clears away
    entry.symlink_to(victim)
    before = files_under(tmp_path, leaving_out=cache)

    result = CliRunner().invoke(
        app,
        ["train", str(DEBUG), *overrides, "--run-dir", str(tmp_path / "run")],
        env={"NO_COLOR": "1", "COLUMNS": "300", "FORGE_CACHE_DIR": str(cache)},
    )

    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert f"the Forge cache entry {entry} is a symbolic link" in output, output
    assert files_under(tmp_path, leaving_out=cache) == before


def test_forge_eval_refuses_dcp_metadata_naming_a_file_outside_the_checkpoint(tmp_path: Path):
    """Before: DCP opened whatever file `.metadata` named for a tensor, `../` included."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    step = fake_step(tmp_path / "ckpt", {})
    (step / CHECKSUMS).unlink()  # a checkpoint from before checksums: loaded unverified, so DCP reads it
    name = "../../outside/secret"
    storage = {MetadataIndex("model.tok_embeddings.weight"): _StorageInfo(name, 0, 8)}
    (step / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={}, storage_data=storage)))

    result = forge("eval", str(step), "--data", "embedded:val", timeout=120)

    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, output
    assert f"{step / '.metadata'} names {name!r}, which is not a plain file name" in output, output
