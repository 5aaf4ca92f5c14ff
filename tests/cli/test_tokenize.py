"""`forge tokenize` as a user runs it: output, --json, and every user error → exit 2, named file, nothing left."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forgecli.app import app
from tests.helpers.data_fixtures import corpus_texts, tokenizer_file, write_jsonl, write_parquet, write_txt

TEXTS = corpus_texts()[:6]
PANEL = re.compile(r"[\s│╭╮╰╯─]+")


def forge(*args: str | Path) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["tokenize", *map(str, args)], env={"NO_COLOR": "1"})
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


def flat(text: str) -> str:
    """Output without the panel's borders and line breaks, so wrapped paths can be searched for."""
    return PANEL.sub("", text)


def test_tokenize_prints_a_summary(tmp_path: Path):
    code, output = forge(
        write_jsonl(tmp_path / "a.jsonl", TEXTS),
        "--out",
        tmp_path / "out",
        "--train-tokenizer",
        "--vocab-size",
        "300",
        "--shard-tokens",
        "2000",
    )
    assert code == 0, output
    assert "tokenizing: 100%" in output and "tokenized" in output and "6 documents" in output.replace("│", "")
    code, output = forge(
        tmp_path / "a.jsonl",
        "--out",
        tmp_path / "out",
        "--train-tokenizer",
        "--vocab-size",
        "300",
        "--shard-tokens",
        "2000",
    )
    assert code == 0 and "already tokenized" in output


def test_tokenize_json(tmp_path: Path):
    code, output = forge(
        write_txt(tmp_path / "docs", TEXTS),
        "--out",
        tmp_path / "out",
        "--tokenizer",
        tokenizer_file(tmp_path),
        "--json",
    )
    assert code == 0, output
    report = json.loads(output[output.index("{") :])
    manifest = report["manifest"]
    assert (
        manifest["total_documents"] == 6
        and manifest["dtype"] == "uint16"
        and manifest["tokenizer"]["vocab_size"] == 400
    )
    assert report["reused_shards"] == 0 and not report["already_complete"]


def test_files_of_an_input_folder_that_are_not_read_are_named(tmp_path: Path):
    """A folder of .txt documents with a README.md and notes.rst beside them: both are named as skipped, the
    .txt files are tokenized, and a hidden file is neither read nor named."""
    folder = write_txt(tmp_path / "docs", TEXTS)
    (folder / "README.md").write_text("# about these documents")
    (folder / "sub").mkdir()
    (folder / "sub" / "notes.rst").write_text("notes")
    (folder / ".cache").write_text("hidden")
    code, output = forge(folder, "--out", tmp_path / "out", "--tokenizer", tok(tmp_path))
    assert code == 0, output
    said = " ".join(output.split())
    assert "skipped 2 file(s) that are not .txt, .jsonl or .parquet" in said, said
    assert "README.md" in said and "notes.rst" in said and ".cache" not in said
    assert f"{len(TEXTS)} documents" in output.replace("│", "")


def tok(tmp: Path) -> Path:
    return tokenizer_file(tmp / "tok")


def docs(tmp: Path) -> Path:
    return write_jsonl(tmp / "docs.jsonl", TEXTS)


def written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def made_dir(path: Path) -> Path:
    path.mkdir()
    return path


# name → tmp → (arguments, a fragment the error must contain: usually the offending file)
CASES = {
    "missing input": lambda t: ([t / "nope.txt", "--tokenizer", tok(t)], str(t / "nope.txt")),
    "empty directory": lambda t: ([made_dir(t / "emptydir"), "--tokenizer", tok(t)], str(t / "emptydir")),
    "only empty files": lambda t: ([written(t / "blank.txt", ""), "--tokenizer", tok(t)], "no documents found"),
    "unknown extension": lambda t: (
        [written(t / "table.csv", "text\nhi\n"), "--tokenizer", tok(t)],
        str(t / "table.csv"),
    ),
    "bad --text-field (jsonl)": lambda t: (
        [docs(t), "--tokenizer", tok(t), "--text-field", "body"],
        str(t / "docs.jsonl"),
    ),
    "bad --text-field (parquet)": lambda t: (
        [write_parquet(t / "d.parquet", TEXTS), "--tokenizer", tok(t), "--text-field", "body"],
        str(t / "d.parquet"),
    ),
    "bad record late in a file": lambda t: (
        [
            written(t / "late.jsonl", docs(t).read_text() + '{"content": "x"}\n'),
            "--tokenizer",
            tok(t),
            "--shard-tokens",
            "100",
        ],
        f"{t / 'late.jsonl'} line 7",
    ),
    "invalid tokenizer file": lambda t: (
        [docs(t), "--tokenizer", written(t / "bad.json", "{not json")],
        str(t / "bad.json"),
    ),
    "missing tokenizer file": lambda t: ([docs(t), "--tokenizer", t / "gone.json"], str(t / "gone.json")),
    "unknown --eos-token": lambda t: ([docs(t), "--tokenizer", tok(t), "--eos-token", "<end>"], "<end>"),
    "both tokenizers": lambda t: ([docs(t), "--tokenizer", tok(t), "--train-tokenizer", "--vocab-size", "300"], "both"),
    "no tokenizer": lambda t: ([docs(t)], "no tokenizer chosen"),
    "training without a size": lambda t: ([docs(t), "--train-tokenizer"], "--vocab-size"),
    "size without training": lambda t: ([docs(t), "--tokenizer", tok(t), "--vocab-size", "300"], "--train-tokenizer"),
    "tiny vocabulary": lambda t: ([docs(t), "--train-tokenizer", "--vocab-size", "100"], "--vocab-size 100"),
    "zero shard size": lambda t: ([docs(t), "--tokenizer", tok(t), "--shard-tokens", "0"], "--shard-tokens"),
}


@pytest.mark.parametrize("case", CASES)
def test_user_errors_exit_2_name_the_problem_and_leave_nothing(tmp_path: Path, case: str):
    args, fragment = CASES[case](tmp_path)
    for out in (tmp_path / "new-out", made_dir(tmp_path / "existing-out")):
        code, output = forge(*args, "--out", out)
        assert code == 2, output
        assert "Traceback" not in output and "fix:" in output
        assert flat(fragment) in flat(output), output
    assert not (tmp_path / "new-out").exists() and not any((tmp_path / "existing-out").iterdir())
