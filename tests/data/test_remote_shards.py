"""Remote data sets for training (engine/data/remote_shards.py) and the one spelling of a source: a
`forge tokenize` output in fsspec's `memory://` store or on an HTTP server on 127.0.0.1 trains to the losses
of the local copy; a fetch that keeps failing exits 2 naming the URL and the field, with nothing half-written,
and the next run fetches only what is missing; two spellings of one source, a source kind that does not exist
and an unreachable URL each exit 2 naming the field; the other spelling of each key means the same source."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
from typer.testing import CliRunner

from engine.config import load_job_config
from engine.data.loader import open_eval_data, open_train_data
from engine.data.remote import FetchError
from engine.data.shards import MANIFEST, open_shard, read_manifest
from engine.data.source_kinds import SourceSpec, entry_source, section_source, train_sources
from engine.data.tokenizer import Encoder
from engine.errors import ConfigError, DataError, UserError
from engine.interp.tokens import open_tokens
from engine.plan import check_config
from engine.plan.length import with_derived_length
from engine.train.trainer import train
from forgecli.app import app
from tests.conftest import REPO
from tests.helpers.data_fixtures import all_tokens, tokenized, tokenizer_file
from tests.helpers.remote import Store
from tests.helpers.remote import server as server  # a fixture

DEBUG = REPO / "presets" / "debug.toml"
TINY = [
    "model.dim=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "train.seq_len=32",
    "model.max_seq_len=32",
    "train.batch_size=2",
    "train.max_steps=3",
    "metrics.log_interval=1",
    "eval.enabled=false",
    "scheduler.warmup_steps=1",
]


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr("engine.data.remote.FIRST_WAIT", 0.01)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small data set of several shards with its tokenizer beside them."""
    return tokenized(tmp_path_factory.mktemp("remote-data"), shard_tokens=2000)


def serve(local: Path) -> None:
    Store.files.update({f"/data/{p.name}": p.read_bytes() for p in local.iterdir() if p.is_file()})


def to_memory(local: Path) -> str:
    root = f"memory://forge-{uuid.uuid4().hex}/data"
    fs = fsspec.filesystem("memory")
    for path in local.iterdir():
        fs.pipe(f"{root.removeprefix('memory://')}/{path.name}", path.read_bytes())
    return root


def losses(cfg, run_dir: Path) -> list[float]:
    train(cfg, run_dir)
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in records if "loss" in r]


def test_training_from_a_remote_data_set_gives_the_local_losses(tmp_path: Path, local: Path, server: str):
    serve(local)
    url = f"{server.replace('http://', 'http://user:secret@')}/data"
    memory = to_memory(local)
    configs = {
        name: load_job_config(DEBUG, [*TINY, f"data.dataset_path={path}"])
        for name, path in {"local": local, "http": url, "memory": memory}.items()
    }
    opened = {name: open_train_data(cfg) for name, cfg in configs.items()}
    assert len(read_manifest(local).shards) >= 3
    for name in ("http", "memory"):
        directory = opened[name].directory
        assert directory.parent.name == "remote" and directory != local  # fetched into the cache, then read
        assert sorted(p.name for p in directory.iterdir()) == sorted(p.name for p in local.iterdir()), name
        assert opened[name].identity() == opened["local"].identity()  # what a checkpoint's train state records
    # Same tokens, same order, CPU and fp32 in one process: the same arithmetic, so equal bit for bit.
    expected = losses(configs["local"], tmp_path / "local")
    assert len(expected) == 3 and losses(configs["http"], tmp_path / "http") == expected
    assert all("secret" not in p.read_text() for p in (tmp_path / "http").rglob("*.json*"))


def test_a_fetch_that_keeps_failing_exits_2_naming_the_url_with_nothing_half_written(
    tmp_path: Path, local: Path, server: str
):
    serve(local)
    shards = read_manifest(local).shards
    last = f"/data/{shards[-1].file}"
    Store.failing.add(last)
    url = f"{server}/data"
    result = CliRunner().invoke(
        app,
        [
            "train",
            str(DEBUG),
            *(f"--{o}" for o in TINY),
            f"--data.dataset_path={url}",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        env={"NO_COLOR": "1", "COLUMNS": "300"},
    )
    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert f"data.dataset_path: could not read {server}{last}: 5 tries failed" in output
    assert not (tmp_path / "run").exists()  # the run wrote nothing
    entry = Path(re.search(rf"fetching {re.escape(url)} into (\S+) \(once", output)[1])
    assert entry.parent.name == "remote" and entry.is_dir()
    left = sorted(p.name for p in entry.iterdir())
    assert MANIFEST not in left and not [n for n in left if n.endswith(".tmp")], left
    assert shards[-1].file not in left and len(left) == len(shards)  # the tokenizer and every whole shard
    for info in shards[:-1]:
        open_shard(entry, info, read_manifest(local).dtype)  # each kept file is whole and checked
    gets = dict(Store.gets)
    Store.failing.clear()
    cfg = load_job_config(DEBUG, [*TINY, f"data.dataset_path={url}"])
    assert open_train_data(cfg).directory == entry and (entry / MANIFEST).is_file()
    fetched_again = {name for name, count in Store.gets.items() if count > gets.get(name, 0)}
    assert fetched_again == {last, "/data/manifest.json"}  # only the missing shard (and the manifest, to key)


def validate(tmp_path: Path, toml: str) -> tuple[int, list[dict]]:
    preset = tmp_path / "p.toml"
    preset.write_text(toml)
    result = CliRunner().invoke(app, ["validate-config", str(preset), "--json"])
    return result.exit_code, json.loads(result.stdout)["errors"]


@pytest.mark.parametrize(
    "toml, field, problem",
    [
        (
            '[data]\ndataset_path = "a"\n[[data.datasets]]\nname = "x"\nembedded = "plays"\n',
            "data.dataset_path",
            "and data.datasets are both set",
        ),
        (
            '[[data.datasets]]\nname = "x"\nhf_name = "a"\nhf_dataset_name = "b"\n',
            "data.datasets.0.hf_dataset_name",
            "and data.datasets.0.hf_name are two spellings of one key, and both are set",
        ),
        ('[data]\npath = "a"\ndataset_path = "b"\n', "data.path", "and data.dataset_path are two spellings"),
        ('[eval]\nhf_name = "a"\nhf_dataset_name = "b"\n', "eval.hf_name", "and eval.hf_dataset_name are two"),
        ('[data]\ndataset_path = "bucket:corpus"\n', "data.dataset_path", "there is no source kind 'bucket'"),
        (
            '[[data.datasets]]\nname = "x"\npath = "gcs:a"\neval_path = "hf:b"\n',
            "data.datasets.0.path",
            "there is no source kind 'gcs'",
        ),
        ('[eval]\nenabled = true\ndataset_path = "hf:wikitext"\n', "eval.dataset_path", "names a Hugging Face"),
        ('[data]\ndataset_path = "embedded:val"\n', "data.dataset_path", "has no split 'val' here"),
    ],
)
def test_bad_source_spellings_exit_2_naming_the_field(tmp_path: Path, toml: str, field: str, problem: str):
    code, errors = validate(tmp_path, toml)
    assert code == 2 and errors[0]["field"] == field and problem in errors[0]["problem"], errors
    if "eval_path" in toml:
        assert len(errors) == 2 and errors[1]["field"] == "data.datasets.0.eval_path", errors
        assert "forge tokenize hf:b --out DIR" in errors[1]["hint"]
    else:
        assert len(errors) == 1, errors


def test_an_unreachable_url_exits_2_naming_the_field(tmp_path: Path):
    cfg = load_job_config(DEBUG, [*TINY, "data.dataset_path=http://127.0.0.1:9/corpus"])
    with pytest.raises(
        FetchError,
        match=r"^data\.dataset_path: could not read http://127\.0\.0\.1:9/corpus/manifest\.json: 5 tries failed",
    ):
        open_train_data(cfg)
    with pytest.raises(UserError, match=r"data\.dataset_path 'nosuch:x': there is no source kind 'nosuch'"):
        train_sources(
            load_job_config(None, ["data.dataset_path=./x"]).model_copy(
                update={"data": load_job_config(None).data.model_copy(update={"dataset_path": "nosuch:x"})}
            )
        )
    encoder = Encoder.from_file(tokenizer_file(tmp_path))  # forge extract / forge eval --data read through it
    with pytest.raises(UserError, match=r"^--data 'bucket:x': there is no source kind 'bucket'"):
        open_tokens(encoder, "bucket:x", None, None)
    with pytest.raises(UserError, match=r"^--data embedded:nope: the embedded corpus has no split 'nope'"):
        open_tokens(encoder, "embedded:nope", None, None)


def test_either_spelling_names_the_same_source(tmp_path: Path):
    flat = load_job_config(
        None, ["data.hf_dataset_name=wiki", "data.hf_dataset_split=test", "data.tokenizer_path=t.json"]
    )
    short = load_job_config(None, ["data.hf_name=wiki", "data.hf_split=test", "data.tokenizer_path=t.json"])
    assert short == flat and section_source(short, "data") == section_source(flat, "data")
    entries = [
        '[[data.datasets]]\nname = "a"\nhf_name = "wiki"\nhf_split = "test"\ntext_field = "body"\n',
        '[[data.datasets]]\nname = "a"\nhf_dataset_name = "wiki"\nhf_dataset_split = "test"\n'
        'hf_dataset_text_field = "body"\n',
    ]
    specs = []
    for i, toml in enumerate(entries):
        (tmp_path / f"{i}.toml").write_text('[data]\ntokenizer_path = "t.json"\n' + toml)
        specs.append(entry_source(load_job_config(tmp_path / f"{i}.toml"), 0))
    assert specs[0] == specs[1] and (specs[0].hub.split, specs[0].hub.text_field) == ("test", "body")
    evaluated = load_job_config(None, ["eval.path=embedded:val", "eval.enabled=true"])
    assert evaluated.eval.dataset_path == "embedded:val"
    assert section_source(evaluated, "eval") == SourceSpec("embedded", "val", "eval.dataset_path")
    with pytest.raises(ConfigError, match=r"data\.datasets\.0\.dataset_path: and data\.datasets\.0\.path are two"):
        load_job_config(None, ['data.datasets=[{name="a", path="x", dataset_path="y"}]'])


def test_embedded_and_remote_spellings_read_the_same_tokens(local: Path):
    named = load_job_config(DEBUG, [*TINY, "data.dataset_path=embedded:train"])
    assert train_sources(named) == train_sources(load_job_config(DEBUG, TINY))  # the default: the embedded train split
    memory = open_train_data(load_job_config(DEBUG, [*TINY, f"data.dataset_path={to_memory(local)}"]))
    shards = read_manifest(local).shards
    assert len(memory.dataset.arrays) == len(shards) >= 3
    assert all(np.array_equal(a, np.load(local / s.file)) for a, s in zip(memory.dataset.arrays, shards))
    encoder = Encoder.from_file(local / "tokenizer.json")  # forge extract / eval --data: the same spelling
    assert np.array_equal(open_tokens(encoder, to_memory(local), None, 3000).read(0, 3000), all_tokens(local)[:3000])


def test_a_store_that_serves_another_tokenizer_is_refused_naming_the_field(
    tmp_path: Path, local: Path, server: str, capsys
):
    serve(local)
    Store.files["/data/tokenizer.json"] = tokenizer_file(tmp_path / "other", vocab_size=300).read_bytes()
    cfg = load_job_config(
        DEBUG, [*TINY, "eval.enabled=true", f"eval.dataset_path={server}/data", "data.dataset_path=" + str(local)]
    )
    with pytest.raises(
        DataError, match=rf"^eval\.dataset_path: {re.escape(server)}/data/tokenizer\.json is not the tok"
    ):
        open_eval_data(cfg)
    entry = Path(re.search(r"into (\S+) \(once", capsys.readouterr().err)[1])
    assert entry.parent.name == "remote" and sorted(p.name for p in entry.iterdir()) == []  # nothing kept


def test_max_epochs_counts_a_remote_data_set_from_its_manifest_alone(local: Path, server: str):
    serve(local)
    overrides = [o for o in TINY if not o.startswith("train.max_steps")] + ["train.max_epochs=1"]
    remote = with_derived_length(
        check_config(load_job_config(DEBUG, [*overrides, f"data.dataset_path={server}/data"])), 1
    )
    assert list(Store.gets) == ["/data/manifest.json"]  # no shard fetched to count the windows
    here = with_derived_length(check_config(load_job_config(DEBUG, [*overrides, f"data.dataset_path={local}"])), 1)
    assert remote.train.max_steps == here.train.max_steps > 1


@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_a_damaged_shard_is_refused_never_cached_and_fetched_again_once_the_store_is_fixed(
    tmp_path: Path, local: Path, server: str, damage: str
):
    """A shard whose bytes changed (same size: its header's dtype signed) or that was cut short is
    refused by the manifest check, is not kept in the entry (which gets no manifest, so is not complete), and
    a run after the store serves the right bytes fetches it and trains."""
    serve(local)
    shards = read_manifest(local).shards
    name = f"/data/{shards[1].file}"
    good = Store.files[name]
    if damage == "corrupt":  # the header's dtype changed in place: what the manifest check compares
        bad = good.replace(b"'descr': '<u", b"'descr': '<i", 1)
    else:
        bad = good[: len(good) // 2]
    assert (len(bad) == len(good)) == (damage == "corrupt") and bad != good
    Store.files[name] = bad
    url = f"{server}/data"
    cli = [
        "train",
        str(DEBUG),
        *(f"--{o}" for o in TINY),
        f"--data.dataset_path={url}",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    result = CliRunner().invoke(app, cli, env={"NO_COLOR": "1", "COLUMNS": "300"})
    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert f"data.dataset_path: {url}/{shards[1].file} does not match its manifest" in output, output
    entry = Path(re.search(rf"fetching {re.escape(url)} into (\S+) \(once", output)[1])
    assert not (entry / MANIFEST).exists() and not (entry / shards[1].file).exists()  # not cached as complete
    Store.files[name] = good
    assert CliRunner().invoke(app, cli, env={"NO_COLOR": "1"}).exit_code == 0
    assert (entry / MANIFEST).is_file() and (entry / shards[1].file).read_bytes() == good
