"""Tokenizing in parts (`--num-shards N --shard-index I`) and `forge tokenize merge`: the merged parts hold the
one-process token sequence, document and token counts; bad parts are refused with exit 2, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from engine.data.parts import Part
from engine.data.shards import read_manifest
from engine.data.sources import FileSource
from engine.data.tokenize import STATE, tokenize, tokenize_files
from engine.errors import DataError
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

TEXTS = corpus_texts()


def forge(*args: str | Path) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["tokenize", *map(str, args)], env={"NO_COLOR": "1", "COLUMNS": "200"})
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


@pytest.fixture
def tok(tmp_path: Path) -> Path:
    return tokenizer_file(tmp_path / "tok")


def few_files(root: Path) -> Path:
    """Files of unequal size (21 kB, 37 kB, 2.5 kB): the cuts at a third and two thirds of the bytes fall inside
    the .jsonl (after its 7th document) and the .parquet file (after its first row)."""
    write_jsonl(root / "a.jsonl", TEXTS[:8])
    write_parquet(root / "b.parquet", TEXTS[8:11], row_group_size=1)
    write_txt(root / "c", TEXTS[11:])
    return root


def many_files(root: Path) -> Path:
    return write_txt(root, TEXTS)  # twelve .txt files: each part a run of whole files


def parts(source: Path, root: Path, tok: Path, count: int = 3) -> list[Path]:
    dirs = []
    for index in range(count):
        code, output = forge(
            source, "--tokenizer", tok, "--shard-tokens", "700", "--num-shards", count, "--shard-index", index,
            "--out", root / f"part-{index}",
        )  # fmt: skip
        assert code == 0, output
        dirs.append(root / f"part-{index}")
    return dirs


@pytest.mark.parametrize("inputs", [few_files, many_files])
def test_merged_parts_hold_the_one_process_tokens_and_counts(tmp_path: Path, tok: Path, inputs):
    source = inputs(tmp_path / "in")
    whole = tokenize_files([source], tmp_path / "whole", tokenizer=tok, shard_tokens=700).manifest
    part_dirs = parts(source, tmp_path / "parts", tok)
    manifests = [read_manifest(d) for d in part_dirs]
    assert [m.source["part"]["index"] for m in manifests] == [0, 1, 2]
    split = [m.total_documents for m in manifests]
    assert split == ([7, 2, 3] if inputs is few_files else [4, 4, 4]), split
    code, output = forge("merge", *reversed(part_dirs), "--out", tmp_path / "merged", "--json")
    assert code == 0, output
    assert json.loads(output)["parts"] == 3
    merged = read_manifest(tmp_path / "merged")
    assert len(all_tokens(tmp_path / "merged")) == whole.total_tokens
    assert np.array_equal(all_tokens(tmp_path / "merged"), all_tokens(tmp_path / "whole"))
    assert (merged.total_tokens, merged.total_documents) == (whole.total_tokens, whole.total_documents)
    assert merged.tokenizer_sha256 == whole.tokenizer_sha256
    assert (tmp_path / "merged" / "tokenizer.json").read_bytes() == (tmp_path / "whole" / "tokenizer.json").read_bytes()
    assert len(merged.shards) == sum(len(m.shards) for m in manifests)
    code, output = forge("merge", *part_dirs, "--out", tmp_path / "merged")
    assert code == 0 and "already merged" in output


def test_an_interrupted_part_resumes_to_the_same_part(tmp_path: Path, tok: Path, monkeypatch):
    monkeypatch.setattr("engine.data.tokenize.BATCH_CHARS", 1)  # one document per batch: stop between any two
    source = few_files(tmp_path / "in")
    part = Part(1, 3)
    clean = tokenize(FileSource([source]), tmp_path / "clean", tokenizer=tok, shard_tokens=300, part=part)
    out = tmp_path / "out"
    with pytest.raises(Interrupt):
        tokenize(FileSource([source]), out, tokenizer=tok, shard_tokens=300, part=part, progress=interrupt_after(2))
    assert (out / STATE).exists()
    resumed = tokenize(FileSource([source]), out, tokenizer=tok, shard_tokens=300, part=part)
    assert resumed.reused_shards >= 2 and resumed.manifest == clean.manifest
    assert np.array_equal(all_tokens(out), all_tokens(tmp_path / "clean"))


def test_bad_part_options_are_refused(tmp_path: Path, tok: Path):
    source = write_jsonl(tmp_path / "a.jsonl", TEXTS[:2])
    out = tmp_path / "out"
    cases = {
        ("--num-shards", "3"): "--num-shards needs --shard-index",
        ("--num-shards", "3", "--shard-index", "3"): "--shard-index 3 is outside 0…2",
        ("--num-shards", "0", "--shard-index", "0"): "--num-shards must be at least 1",
        ("--num-shards", "9", "--shard-index", "1"): "part 1 of 9 holds no documents",
    }
    for args, message in cases.items():
        code, output = forge(source, "--tokenizer", tok, *args, "--out", out)
        assert code == 2 and message in output, output
        assert not out.exists()
    code, output = forge(source, "--train-tokenizer", "--vocab-size", "300", "--num-shards", "2", "--shard-index", "0",
                         "--out", out)  # fmt: skip
    assert code == 2 and "--train-tokenizer cannot be used with --num-shards" in output
    assert not out.exists()


def test_merge_refuses_parts_that_do_not_make_one_data_set(tmp_path: Path, tok: Path):
    source = many_files(tmp_path / "in")
    good = parts(source, tmp_path / "parts", tok)
    other_tok = tokenizer_file(tmp_path / "tok2", vocab_size=380)
    odd = tmp_path / "odd"
    code, _ = forge(source, "--tokenizer", other_tok, "--shard-tokens", "700", "--num-shards", "3", "--shard-index",
                    "1", "--out", odd)  # fmt: skip
    assert code == 0
    unfinished = tmp_path / "unfinished"
    shutil.copytree(good[2], unfinished)
    (unfinished / "manifest.json").unlink()
    whole = tmp_path / "whole"
    tokenize_files([source], whole, tokenizer=tok, shard_tokens=700)
    cases = {
        (good[0], odd, good[2]): f"part {odd} was tokenized with another tokenizer",
        (good[0], good[1], unfinished): f"part {unfinished} is not finished",
        (good[0], good[1]): "parts 2 of 3 are missing",
        (good[0], good[1], good[1], good[2]): "part 1 is given twice",
        (good[0], whole): f"{whole} is not a part",
    }
    for given, message in cases.items():
        code, output = forge("merge", *given, "--out", tmp_path / "merged")
        assert code == 2 and message in " ".join(output.split()).replace("│", ""), output
        assert not (tmp_path / "merged").exists()


def test_a_stream_of_unknown_length_cannot_be_split(tok: Path):
    class Stream:
        total = None
        unit = "rows"

        def describe(self) -> list[str]:
            return ["hf:some/stream"]

    with pytest.raises(DataError, match=r"--num-shards needs the input's length, and hf:some/stream"):
        from engine.data.parts import PartSource

        PartSource(Stream(), Part(0, 2))
