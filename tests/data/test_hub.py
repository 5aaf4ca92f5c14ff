"""Tokenizing a Hugging Face dataset (`forge tokenize hf:NAME`), eager and streaming, offline.

The datasets are local: a folder of data files, which `datasets.load_dataset` reads the way it reads a Hub
repository, and folders written by `save_to_disk`. The reference is the same rows tokenized from a JSONL file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from engine.data.hub import HubSource
from engine.data.source_kinds import section_source, source_directory
from engine.data.tokenize import STATE, open_source, tokenize, tokenize_files
from engine.errors import DataError
from engine.plan import check_config
from tests.conftest import REPO
from tests.helpers.data_fixtures import (
    Interrupt,
    all_tokens,
    corpus_texts,
    interrupt_after,
    tokenizer_file,
    write_jsonl,
)

TEXTS = corpus_texts()
HELD_OUT = ("Held-out text, first.", "   ", "Held-out text, second.")  # the blank row is skipped, as in files


@pytest.fixture
def tok(tmp_path: Path) -> Path:
    return tokenizer_file(tmp_path / "tok")


@pytest.fixture
def dataset_repo(tmp_path: Path) -> Path:
    """A dataset laid out as on the Hub: data/train.jsonl and data/test.jsonl."""
    root = tmp_path / "repo"
    write_jsonl(root / "data" / "train.jsonl", TEXTS)
    write_jsonl(root / "data" / "test.jsonl", HELD_OUT)
    return root


def hub(name: Path | str, **options) -> HubSource:
    return HubSource(str(name), **options)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_dataset_gives_the_tokens_of_the_same_rows_in_a_file(
    tmp_path: Path, tok: Path, dataset_repo: Path, streaming: bool
):
    reference = tokenize_files(
        [dataset_repo / "data" / "train.jsonl"], tmp_path / "files", tokenizer=tok, shard_tokens=700
    )
    report = tokenize(hub(dataset_repo, streaming=streaming), tmp_path / "hub", tokenizer=tok, shard_tokens=700)
    assert np.array_equal(all_tokens(report.directory), all_tokens(reference.directory))
    assert [s.tokens for s in report.manifest.shards] == [s.tokens for s in reference.manifest.shards]
    assert report.manifest.total_documents == len(TEXTS)
    assert report.manifest.source["inputs"] == [f"hf:{dataset_repo} split 'train'"]


def test_another_split_and_a_trained_tokenizer(tmp_path: Path, dataset_repo: Path):
    trained = tokenize(hub(dataset_repo, split="test", streaming=True), tmp_path / "test", train_vocab_size=280)
    reference = tokenize_files([dataset_repo / "data" / "test.jsonl"], tmp_path / "ref", train_vocab_size=280)
    assert trained.manifest.total_documents == 2
    assert (trained.directory / "tokenizer.json").read_bytes() == (reference.directory / "tokenizer.json").read_bytes()
    assert np.array_equal(all_tokens(trained.directory), all_tokens(reference.directory))


@pytest.mark.parametrize("streaming", [False, True])
def test_an_interrupted_run_resumes_to_identical_output(
    tmp_path: Path, tok: Path, dataset_repo: Path, monkeypatch: pytest.MonkeyPatch, streaming: bool
):
    monkeypatch.setattr("engine.data.tokenize.BATCH_CHARS", 1)  # one document per batch: stop between any two
    clean = tokenize(hub(dataset_repo, streaming=streaming), tmp_path / "clean", tokenizer=tok, shard_tokens=600)
    out = tmp_path / "out"
    with pytest.raises(Interrupt):
        tokenize(
            hub(dataset_repo, streaming=streaming), out, tokenizer=tok, shard_tokens=600, progress=interrupt_after(5)
        )
    recorded = json.loads((out / STATE).read_text())
    assert len(recorded["shards"]) >= 5 and recorded["resume"][1] > 0
    resumed = tokenize(hub(dataset_repo, streaming=streaming), out, tokenizer=tok, shard_tokens=600)
    assert resumed.reused_shards == len(recorded["shards"]) < len(clean.manifest.shards)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in clean.directory.iterdir())
    for path in clean.directory.iterdir():
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name


def test_a_rerun_with_another_split_restarts_instead_of_resuming(tmp_path: Path, tok: Path, dataset_repo: Path):
    out = tmp_path / "out"
    with pytest.raises(Interrupt):
        tokenize(hub(dataset_repo), out, tokenizer=tok, shard_tokens=600, progress=interrupt_after(2))
    report = tokenize(hub(dataset_repo, split="test"), out, tokenizer=tok, shard_tokens=600)
    assert report.reused_shards == 0 and report.manifest.total_documents == 2


def test_folders_written_by_save_to_disk(tmp_path: Path, tok: Path, dataset_repo: Path):
    import datasets

    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": list(TEXTS)}),
            "test": datasets.Dataset.from_dict({"text": list(HELD_OUT)}),
        }
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    splits["test"].save_to_disk(str(tmp_path / "one"))
    reference = tokenize_files([dataset_repo / "data" / "test.jsonl"], tmp_path / "ref", tokenizer=tok)
    for name, split, streaming in [
        ("dict", "test", False),
        ("dict", "test", True),
        ("one", None, False),
        ("one", None, True),
    ]:
        source = hub(tmp_path / name, split=split, streaming=streaming)
        report = tokenize(source, tmp_path / f"out-{name}-{streaming}", tokenizer=tok)
        assert np.array_equal(all_tokens(report.directory), all_tokens(reference.directory)), (name, streaming)
    assert str(hub(tmp_path / "one")) == f"hf:{tmp_path / 'one'}"  # a lone Dataset records no split name
    with pytest.raises(DataError, match="has no split 'validation'"):
        hub(tmp_path / "dict", split="validation")
    with pytest.raises(DataError, match="holds one data set without a split name, not 'test'"):
        hub(tmp_path / "one", split="test")
    with pytest.raises(DataError, match="has no configurations"):
        hub(tmp_path / "dict", config="en")


def test_a_dataset_that_cannot_be_loaded_is_a_data_error(tmp_path: Path, dataset_repo: Path):
    with pytest.raises(DataError, match='Unknown split "validation"'):
        hub(dataset_repo, split="validation")
    with pytest.raises(DataError, match="could not load Hugging Face dataset"):
        hub(tmp_path / "missing", streaming=True)
    with pytest.raises(DataError, match="is a local folder"):
        hub(dataset_repo, revision="main")  # a revision would be read by nothing
    script = tmp_path / "scripted"
    script.mkdir()
    (script / "scripted.py").write_text("import datasets\n")  # loading scripts: refused by datasets
    with pytest.raises(DataError, match="could not load Hugging Face dataset"):
        hub(script)


def test_a_row_that_cannot_be_parsed_midway_leaves_nothing_behind(tmp_path: Path, tok: Path, dataset_repo: Path):
    with open(dataset_repo / "data" / "train.jsonl", "a") as f:
        f.write("{not json\n")
    # datasets < 5 reads the first rows when the stream is opened, later versions when they are iterated
    with pytest.raises(DataError, match=r"could not (read the rows|load Hugging Face dataset)"):
        tokenize(hub(dataset_repo, streaming=True), tmp_path / "out", tokenizer=tok, shard_tokens=500)
    assert not (tmp_path / "out").exists()


def test_a_stream_whose_data_changed_restarts_instead_of_resuming(tmp_path: Path, tok: Path, dataset_repo: Path):
    out = tmp_path / "out"
    with pytest.raises(Interrupt):
        tokenize(hub(dataset_repo, streaming=True), out, tokenizer=tok, shard_tokens=600, progress=interrupt_after(2))
    write_jsonl(dataset_repo / "data" / "train.jsonl", TEXTS[::-1])
    report = tokenize(hub(dataset_repo, streaming=True), out, tokenizer=tok, shard_tokens=600)
    fresh = tokenize_files([dataset_repo / "data" / "train.jsonl"], tmp_path / "fresh", tokenizer=tok, shard_tokens=600)
    assert report.reused_shards == 0
    assert np.array_equal(all_tokens(report.directory), all_tokens(fresh.directory))


def test_columns_are_checked_before_anything_is_written(tmp_path: Path, tok: Path, dataset_repo: Path):
    with pytest.raises(DataError, match=r"has no column 'body' \(columns: id, text\)"):
        tokenize(hub(dataset_repo), tmp_path / "out", tokenizer=tok, text_field="body")
    with pytest.raises(DataError, match="column 'id' has type"):
        tokenize(hub(dataset_repo), tmp_path / "out", tokenizer=tok, text_field="id")
    assert not (tmp_path / "out").exists()


def test_a_null_row_late_in_the_dataset_leaves_nothing_behind(tmp_path: Path, tok: Path):
    import datasets

    datasets.Dataset.from_dict({"text": [*TEXTS, None]}).save_to_disk(str(tmp_path / "nulls"))
    with pytest.raises(DataError, match=r"row 12: column 'text' is null"):
        tokenize(hub(tmp_path / "nulls", streaming=True), tmp_path / "out", tokenizer=tok, shard_tokens=500)
    assert not (tmp_path / "out").exists()


def test_the_command_line_names_one_source(tmp_path: Path, dataset_repo: Path):
    with pytest.raises(DataError, match="must be the only input"):
        open_source([f"hf:{dataset_repo}", str(dataset_repo / "data")])
    with pytest.raises(DataError, match="--split, --streaming apply only to a Hugging Face dataset"):
        open_source([str(dataset_repo / "data")], split="test", streaming=True)
    with pytest.raises(DataError, match="names no dataset"):
        open_source(["hf:"])
    assert isinstance(open_source([f"hf:{dataset_repo}"], split="test"), HubSource)


def test_without_the_datasets_package_the_error_says_what_to_install(
    dataset_repo: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setitem(sys.modules, "datasets", None)  # what an environment without it gives: ImportError
    with pytest.raises(DataError, match="needs the datasets package") as error:
        hub(dataset_repo)
    assert "pip install 'forge-lm[hf]'" in error.value.hint


def forge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "forgecli.app", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "NO_COLOR": "1", "COLUMNS": "300"},
    )


def test_cli_streams_a_dataset_and_refuses_a_bad_split(tmp_path: Path, dataset_repo: Path):
    import datasets

    datasets.Dataset.from_dict({"text": list(TEXTS)}).save_to_disk(
        str(tmp_path / "saved")
    )  # a stream of unknown length
    out = tmp_path / "out"
    result = forge(
        "tokenize",
        f"hf:{tmp_path / 'saved'}",
        "--streaming",
        "--train-tokenizer",
        "--vocab-size",
        "300",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert f"{len(TEXTS)} rows read" in result.stdout  # progress counts rows when the stream's length is unknown
    assert json.loads((out / "manifest.json").read_text())["source"]["inputs"] == [f"hf:{tmp_path / 'saved'}"]

    # Mistakes that need no data are found before the dataset is prepared (eager mode converts every
    # split; nothing has prepared this one yet).
    for args, message in [
        (("--out", str(tmp_path / "early")), "no tokenizer chosen"),
        (("--out", str(dataset_repo), "--train-tokenizer", "--vocab-size", "300"), "did not write"),
    ]:
        result = forge("tokenize", f"hf:{dataset_repo}", *args)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert "Generating" not in result.stderr  # the datasets library's own progress while it prepares a split
    assert not (tmp_path / "early").exists()

    bad = forge(
        "tokenize",
        f"hf:{dataset_repo}",
        "--split",
        "validation",
        "--train-tokenizer",
        "--vocab-size",
        "300",
        "--out",
        str(tmp_path / "bad"),
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "validation" in bad.stderr and "--split" in bad.stderr
    assert not (tmp_path / "bad").exists()


# --- training on a dataset named in the config (data.hf_dataset_name, eval.hf_dataset_name) ------------------

TINY = [
    "model.dim=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.vocab_size=512",
    "train.seq_len=32",
    "model.max_seq_len=32",
    "train.batch_size=4",
    "train.max_steps=4",
    "metrics.log_interval=1",
    "eval.enabled=true",
    "eval.interval=2",
    "eval.steps=2",
    "scheduler.warmup_steps=1",
]


def trained_records(run_dir: Path, *overrides: str) -> list[dict]:
    from engine.config import load_job_config
    from engine.train.trainer import train

    train(load_job_config(None, [*TINY, *overrides]), run_dir)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def numbers(records: list[dict]) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("grad_norm"), r.get("eval_loss")) for r in records]


@pytest.mark.parametrize("streaming", [False, True])
def test_training_on_a_named_dataset_equals_training_on_its_tokenized_shards(
    tmp_path: Path, tok: Path, streaming: bool, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "cache"))
    repo = tmp_path / "repo"
    write_jsonl(repo / "data" / "train.jsonl", TEXTS[3:])
    write_jsonl(repo / "data" / "test.jsonl", TEXTS[:3])
    shards = tokenize_files([repo / "data" / "train.jsonl"], tmp_path / "shards", tokenizer=tok).directory
    held_out = tokenize_files([repo / "data" / "test.jsonl"], tmp_path / "held-out", tokenizer=tok).directory
    reference = trained_records(tmp_path / "ref", f"data.dataset_path={shards}", f"eval.dataset_path={held_out}")

    named = [
        f"data.hf_dataset_name={repo}",
        f"data.tokenizer_path={tok}",
        f"eval.hf_dataset_name={repo}",
        "eval.hf_dataset_split=test",
        f"data.hf_streaming={str(streaming).lower()}",
    ]
    records = trained_records(tmp_path / "hub", *named)
    assert numbers(records) == numbers(reference)  # the same tokens in the same order: the same run, exactly
    assert [r["eval_loss"] for r in records if "eval_loss" in r]
    assert (tmp_path / "hub" / "tokenizer.json").read_bytes() == tok.read_bytes()

    entries = sorted((tmp_path / "cache" / "hf").glob("*/manifest.json"))
    assert len(entries) == 2  # the training split and the held-out split, each tokenized once
    monkeypatch.setattr("engine.data.hub_cache.tokenize", None)  # a second run must not tokenize again
    again = trained_records(tmp_path / "again", *named)
    assert numbers(again) == numbers(records)


def test_a_named_dataset_needs_a_tokenizer_and_its_fields_need_a_name():
    from engine.config import load_job_config
    from engine.errors import ConfigError

    def issues(*overrides: str) -> list[str]:
        with pytest.raises(ConfigError) as error:
            check_config(load_job_config(None, list(overrides)), 1)
        return [issue.path for issue in error.value.issues]

    assert issues("data.hf_dataset_name=org/set") == ["data.tokenizer_path"]
    assert issues("data.hf_dataset_name=org/set", "data.dataset_path=/x", "data.tokenizer_path=t.json") == [
        "data.hf_dataset_name"
    ]
    assert sorted(
        issues(
            "data.hf_dataset_config=en",
            "data.hf_dataset_split=test",
            "data.hf_streaming=true",
            "data.hf_dataset_revision=v1",
            "eval.enabled=true",
            "eval.hf_dataset_split=test",
            "data.hf_dataset_text_field=body",
        )
    ) == [
        "data.hf_dataset_config",
        "data.hf_dataset_revision",
        "data.hf_dataset_split",
        "data.hf_dataset_text_field",
        "data.hf_streaming",
        "eval.hf_dataset_split",
    ]
    assert issues("eval.enabled=true", "eval.hf_dataset_name=org/set", "eval.dataset_path=/x") == [
        "eval.hf_dataset_name"
    ]
    assert issues("data.hf_dataset_name=org/set", "data.tokenizer_path=t.json", "eval.enabled=true") == [
        "eval.dataset_path"
    ]  # held-out data of its own, as with dataset_path
    check_config(
        load_job_config(
            None,
            [
                "data.hf_dataset_name=org/set",
                "data.tokenizer_path=t.json",
                "eval.enabled=true",
                "eval.hf_dataset_name=org/set",
            ],
        ),
        1,
    )


BUILD_SCRIPT = """
import sys, time
from pathlib import Path
from engine.config import load_job_config
from engine.data.source_kinds import section_source, source_directory
cfg = load_job_config(None, [f"data.hf_dataset_name={sys.argv[1]}", f"data.tokenizer_path={sys.argv[2]}",
                             "model.vocab_size=512"])
while not Path(sys.argv[3]).exists():  # start together, as the ranks of a job do
    time.sleep(0.01)
print(source_directory(cfg, section_source(cfg, "data"), lambda: Path(sys.argv[2])), flush=True)
"""


def test_ranks_asking_for_the_same_dataset_at_once_tokenize_it_once(tmp_path: Path, tok: Path, dataset_repo: Path):
    env = {**os.environ, "FORGE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    go = tmp_path / "go"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD_SCRIPT, str(dataset_repo), str(tok), str(go)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    time.sleep(3)
    go.touch()
    outputs = [rank.communicate(timeout=240) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), [err[-2000:] for _, err in outputs]
    assert len({out.strip() for out, _ in outputs}) == 1  # one entry for all
    assert sum("tokenizing hf:" in err for _, err in outputs) == 1, [err[-2000:] for _, err in outputs]
    entry = Path(outputs[0][0].strip())
    reference = tokenize_files([dataset_repo / "data" / "train.jsonl"], tmp_path / "ref", tokenizer=tok)
    assert np.array_equal(all_tokens(entry), all_tokens(reference.directory))


def test_resuming_onto_data_that_changed_is_refused(tmp_path: Path, tok: Path, monkeypatch: pytest.MonkeyPatch):
    from engine.errors import UserError

    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "cache"))
    repo = tmp_path / "repo"
    write_jsonl(repo / "data" / "train.jsonl", TEXTS)
    named = [
        f"data.hf_dataset_name={repo}",
        f"data.tokenizer_path={tok}",
        "eval.enabled=false",
        "scheduler.decay_steps=4",
        "train.max_steps=2",
        "checkpoint.interval=2",
    ]
    trained_records(tmp_path / "run", *named)
    write_jsonl(repo / "data" / "train.jsonl", TEXTS[::-1])  # the dataset changes (a new commit on the Hub, say)
    with pytest.raises(UserError, match="was trained on other data"):
        trained_records(tmp_path / "run", *named[:-2], "train.max_steps=4", "checkpoint.interval=2")
    write_jsonl(repo / "data" / "train.jsonl", TEXTS)  # the data it trained on, now in another folder: it goes ahead
    moved = repo.rename(tmp_path / "moved")
    records = trained_records(
        tmp_path / "run", f"data.hf_dataset_name={moved}", *named[1:-2], "train.max_steps=4", "checkpoint.interval=2"
    )
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]


def test_mistakes_in_a_named_dataset_name_its_fields_and_cost_no_tokenizing(
    tmp_path: Path, tok: Path, dataset_repo: Path, monkeypatch: pytest.MonkeyPatch
):
    from engine.config import load_job_config
    from engine.data.loader import open_train_data

    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "cache"))
    named = [f"data.hf_dataset_name={dataset_repo}", f"data.tokenizer_path={tok}", "model.vocab_size=512"]
    with pytest.raises(DataError, match=r"data.hf_dataset_name: .*Unknown split") as error:
        open_train_data(load_job_config(None, [*named, "data.hf_dataset_split=dev"]))
    assert "data.hf_dataset_split" in error.value.hint
    with pytest.raises(DataError, match="no column 'body'") as error:
        open_train_data(load_job_config(None, [*named, "data.hf_dataset_text_field=body"]))
    assert "data.hf_dataset_text_field" in error.value.hint
    with pytest.raises(DataError, match=r"more than model.vocab_size = 100"):
        open_train_data(load_job_config(None, [*named, "model.vocab_size=100"]))
    assert not (tmp_path / "cache" / "hf").exists()


def test_a_cache_build_reports_through_the_view_the_cli_installs(
    tmp_path: Path, tok: Path, dataset_repo: Path, monkeypatch: pytest.MonkeyPatch
):
    """`forge train` on a terminal shows the build of a config-named dataset as a Rich bar: the engine hands
    its progress to whatever view is installed, from the first batch to the whole input read."""
    import contextlib

    from engine.config import load_job_config
    from engine.data.hub_cache import progress_shown_by

    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "cache"))
    cfg = load_job_config(
        None, [f"data.hf_dataset_name={dataset_repo}", f"data.tokenizer_path={tok}", "model.vocab_size=512"]
    )
    seen: list[tuple[str, object]] = []

    @contextlib.contextmanager
    def view(name: str):
        yield lambda p: seen.append((name, p))

    with progress_shown_by(view):
        entry = source_directory(cfg, section_source(cfg, "data"), lambda: tok)
    assert seen and {name for name, _ in seen} == {f"hf:{dataset_repo} split 'train'"}
    last = seen[-1][1]
    assert last.phase == "tokenizing" and last.done == last.total == len(TEXTS)
    assert last.tokens == all_tokens(entry).size


# --- a Hugging Face dataset as a mixture source ([[data.datasets]] hf_name) ----------------------------------


def test_a_mixture_with_a_hugging_face_source_trains_and_reuses_its_cache(
    tmp_path: Path, dataset_repo: Path, monkeypatch: pytest.MonkeyPatch
):
    """`forge train` on shards from `forge tokenize` mixed with a local dataset folder named by hf_name: the
    folder is tokenized once into the cache (with the tokenizer beside the shards), both sources train and
    report; a second run finds the entry and tokenizes nothing, training on the same tokens."""
    from tests.helpers.data_fixtures import tokenized

    cache = tmp_path / "cache"
    monkeypatch.setenv("FORGE_CACHE_DIR", str(cache))
    shards = tokenized(tmp_path, TEXTS[:6], name="shards")
    sources = (
        f'--data.datasets=[{{name="files", path="{shards}", weight=1.0}}, '
        f'{{name="hub", hf_name="{dataset_repo}", hf_split="train", text_field="text", weight=1.0}}]'
    )
    args = [f"--{o}" for o in TINY if not o.startswith("eval.")] + ["--eval.enabled=false", sources]
    result = forge("train", "presets/debug.toml", "--run-dir", str(tmp_path / "run"), *args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "tokenizing" in result.stderr
    entries = sorted((cache / "hf").glob("*/manifest.json"))
    assert len(entries) == 1
    from engine.data.shards import read_manifest

    assert read_manifest(entries[0].parent).tokenizer_sha256 == read_manifest(shards).tokenizer_sha256
    first = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in first if "loss" in r][-1]
    assert last["step"] == 4 and last["data/tokens/files"] > 0 and last["data/tokens/hub"] > 0
    assert last["data/tokens/files"] + last["data/tokens/hub"] == 4 * 4 * 32
    assert any("loss/hub" in r for r in first) and any("loss/files" in r for r in first)

    monkeypatch.setattr("engine.data.hub_cache.tokenize", None)  # the second run must not tokenize again
    from engine.config import load_job_config
    from engine.train.trainer import train

    train(load_job_config(REPO / "presets" / "debug.toml", args), tmp_path / "again")
    again = [json.loads(line) for line in (tmp_path / "again" / "metrics.jsonl").read_text().splitlines()]
    assert numbers(again) == numbers(first)
    assert sorted((cache / "hf").glob("*/manifest.json")) == entries


def test_bad_hugging_face_sources_exit_2_naming_the_field(tmp_path: Path, dataset_repo: Path):
    """hf_name beside path (found by validate-config), a text column the dataset lacks (found when the data is
    opened, before tokenizing or any process group), and a source tokenized with another tokenizer than the
    run's, also when a Hugging Face source comes before it (every source with shards is opened before any
    Hugging Face source is tokenized): exit 2, the field named, nothing tokenized, no run directory written."""
    from tests.helpers.data_fixtures import tokenized

    shards = tokenized(tmp_path, TEXTS[:6], name="shards")
    files, hub = f'{{name="files", path="{shards}"}}', f'{{name="hub", hf_name="{dataset_repo}"}}'
    cases = [
        ("validate-config", f'{files}, {{name="hub", hf_name="{dataset_repo}", path="{shards}"}}', ["data.datasets.1.hf_name", "and data.datasets.1.path are both set"]),
        ("train", f'{files}, {{name="hub", hf_name="{dataset_repo}", text_field="body"}}', ["data.datasets.1.hf_name", "no column 'body'", "data.datasets.1.text_field"]),
        ("train", f'{files}, {{name="poems", embedded="poems"}}', ["data.datasets.1.embedded", "different tokenizer"]),
        ("train", f'{hub}, {files}, {{name="poems", embedded="poems"}}', ["data.datasets.2.embedded", "different tokenizer", "data.datasets.1"]),
    ]  # fmt: skip
    for command, entries, expected in cases:
        sources = f"--data.datasets=[{entries}]"
        run_dir = tmp_path / "run"
        where = ["--run-dir", str(run_dir)] if command == "train" else []
        result = forge(command, "presets/debug.toml", *where, "--eval.enabled=false", sources)
        output = " ".join((result.stdout + result.stderr).replace("│", " ").split())
        assert result.returncode == 2, output[-3000:]
        assert all(text in output for text in expected), (expected, output[-3000:])
        assert "Traceback" not in output and "tokenizing" not in output and not run_dir.exists()
