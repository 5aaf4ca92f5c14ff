"""One source type: every spelling of a source (the flat [data] / [eval] fields, a [[data.datasets]] entry) reads
into a `SourceSpec`, the loader resolves any spec through the `SOURCE_KINDS` registry, and every preset (the seed
framework's included) resolves to the sources its TOML names."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from engine.config import load_job_config
from engine.config.base import Section
from engine.config.registry import SOURCE_KINDS
from engine.data.source_kinds import SourceSpec, section_source, source_directory, train_sources
from tests.conftest import REPO
from tests.helpers import source_golden

PRESETS = sorted([*REPO.glob("presets/*.toml"), *REPO.glob("tests/seed_presets/*.toml")])


def expected_sources(raw: dict) -> list[tuple[str, str, str]]:
    """What the TOML itself names, read without Forge: entries, else the flat fields, else the embedded corpus."""
    data = raw.get("data", {})
    entries = data.get("datasets", [])
    if entries:
        found = []
        for i, entry in enumerate(entries):
            key = next(k for k in ("hf_name", "path", "embedded") if k in entry)
            kind = {"hf_name": "hf", "path": "shards", "embedded": "embedded"}[key]
            found.append((kind, entry[key], f"data.datasets.{i}.{key}"))
        return found
    if "dataset_path" in data:
        return [("shards", data["dataset_path"], "data.dataset_path")]
    if "hf_dataset_name" in data:
        return [("hf", data["hf_dataset_name"], "data.hf_dataset_name")]
    return [("embedded", "train", "data.dataset_path")]


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_preset_resolves_to_the_sources_its_toml_names(path: Path):
    cfg = load_job_config(path)
    got = [(s.kind, s.location, s.field) for s in train_sources(cfg)]
    assert len(got) >= 1 and got == expected_sources(tomllib.loads(path.read_text()))
    evaluated = tomllib.loads(path.read_text()).get("eval", {}).get("dataset_path")
    spec = section_source(cfg, "eval")
    assert (spec.location if spec else None) == evaluated


def test_every_preset_resolves_to_its_sources_and_data_identity_from_before():
    """The golden file was recorded from main before a source could be spelled two ways (tests/helpers/source_golden.py):
    the same sources, eval source and, where the data is here (the embedded corpus), the same identity."""
    golden = json.loads(source_golden.GOLDEN.read_text())
    now = source_golden.snapshot()
    assert len(now) == len(golden) == len(PRESETS) and now == golden
    assert sum(entry["identity"] is not None for entry in now.values()) >= 16


def test_the_loader_looks_source_kinds_up_in_the_registry(tmp_path: Path):
    asked = []

    def bucket(spec: SourceSpec, cfg, tokenizer) -> Path:
        asked.append((spec.location, tokenizer()))
        return tmp_path / spec.location

    with SOURCE_KINDS.restored():
        SOURCE_KINDS.register("bucket", directory=bucket, describe="a bucket")(Section)
        cfg = load_job_config(REPO / "presets" / "debug.toml")
        spec = SourceSpec("bucket", "b1", "data.datasets.0.bucket")
        got = source_directory(cfg, spec, lambda: tmp_path / "tok.json")
        assert got == tmp_path / "b1" and asked == [("b1", tmp_path / "tok.json")]
        assert SOURCE_KINDS.names() == ["bucket", "embedded", "hf", "remote", "shards"]
    shards = source_directory(cfg, SourceSpec("shards", str(tmp_path / "s"), "data.dataset_path"), lambda: None)
    assert shards == tmp_path / "s"
