"""Preset includes: `include = [...]` chains, how they merge, and the errors that name the chain."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from engine.config import dump_toml, load_job_config
from engine.config.loader import field_sources, read_preset
from engine.errors import ConfigError
from tests.helpers.cli import forge


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def chain(tmp_path: Path) -> Path:
    """run.toml → mid/size.toml → ../common/base.toml (and common/optim.toml), paths relative to each file."""
    write(
        tmp_path / "common/base.toml",
        """
        [model]
        dim = 64
        n_layers = 2
        n_heads = 4
        [optimizer]
        lr = 0.001
        weight_decay = 0.1
        [train]
        max_steps = 10
        """,
    )
    write(tmp_path / "common/optim.toml", "[optimizer]\nlr = 0.002\nbetas = [0.9, 0.95]\n")
    write(
        tmp_path / "mid/size.toml",
        """
        include = ["../common/base.toml", "../common/optim.toml"]
        [model]
        n_layers = 4
        """,
    )
    return write(
        tmp_path / "run.toml",
        """
        include = ["mid/size.toml"]
        [optimizer]
        weight_decay = 0.0
        [train]
        seq_len = 32
        """,
    )


def test_three_level_chain_merges_and_overrides(chain: Path):
    cfg = load_job_config(chain, ["--train.max_steps=7"])
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads) == (64, 4, 4)  # merged key by key
    assert cfg.optimizer.lr == 0.002  # the later include overrides the earlier
    assert list(cfg.optimizer.betas) == [0.9, 0.95]
    assert cfg.optimizer.weight_decay == 0.0  # the including file overrides its includes
    assert cfg.train.seq_len == 32 and cfg.train.max_steps == 7  # the command line overrides them all


def test_sources_name_the_file_that_set_each_field(chain: Path):
    cfg = load_job_config(chain, ["--train.max_steps=7"])
    sources = field_sources(cfg, chain, ["--train.max_steps=7"])
    root = chain.parent
    assert sources["model.dim"] == str(root / "mid/../common/base.toml")
    assert sources["model.n_layers"] == str(root / "mid/size.toml")
    assert sources["optimizer.lr"] == str(root / "mid/../common/optim.toml")
    assert sources["optimizer.weight_decay"] == str(chain)
    assert sources["train.max_steps"] == "override"
    assert sources["model.vocab_size"] == "default"


def test_resolved_config_has_no_include_and_reloads_the_same(chain: Path, tmp_path: Path):
    cfg = load_job_config(chain)
    text = dump_toml(cfg)
    assert "include" not in text
    again = write(tmp_path / "elsewhere/config.toml", text)
    assert load_job_config(again) == cfg


def test_arrays_of_tables_replace_instead_of_appending(tmp_path: Path):
    write(
        tmp_path / "base.toml", '[[train.hooks]]\ntarget = "a:A"\n[[train.hooks]]\ntarget = "b:B"\n[train]\nseed = 1\n'
    )
    top = write(tmp_path / "top.toml", 'include = ["base.toml"]\n[[train.hooks]]\ntarget = "c:C"\n')
    preset = read_preset(top)
    assert preset.raw["train"] == {"hooks": [{"target": "c:C"}], "seed": 1}
    assert preset.sources["train.hooks"] == str(top) and preset.sources["train.seed"] == str(tmp_path / "base.toml")
    assert [hook.target for hook in load_job_config(top).train.hooks] == ["c:C"]


def test_a_table_replaced_by_a_value_forgets_its_old_sources(tmp_path: Path):
    write(tmp_path / "base.toml", "[x.y]\nz = 1\n")
    top = write(tmp_path / "top.toml", 'include = ["base.toml"]\n[x]\ny = 2\n')
    preset = read_preset(top)
    assert preset.raw == {"x": {"y": 2}} and preset.sources == {"x.y": str(top)}


def test_a_cycle_is_an_error_naming_the_chain(tmp_path: Path):
    write(tmp_path / "a.toml", 'include = ["sub/b.toml"]\n')
    write(tmp_path / "sub/b.toml", 'include = ["../a.toml"]\n')
    with pytest.raises(ConfigError, match="include cycle") as err:
        load_job_config(tmp_path / "a.toml")
    assert f"{tmp_path / 'a.toml'} → {tmp_path / 'sub/b.toml'} → {tmp_path / 'sub/../a.toml'}" in str(err.value)


def test_a_shared_base_included_twice_is_not_a_cycle(tmp_path: Path):
    write(tmp_path / "base.toml", "[train]\nseed = 3\n")
    write(tmp_path / "x.toml", 'include = ["base.toml"]\n[train]\nmax_steps = 5\n')
    top = write(tmp_path / "top.toml", 'include = ["base.toml", "x.toml"]\n')
    cfg = load_job_config(top)
    assert (cfg.train.seed, cfg.train.max_steps) == (3, 5)


def test_missing_include_and_bad_include_value(tmp_path: Path):
    write(tmp_path / "mid.toml", 'include = ["nowhere.toml"]\n')
    top = write(tmp_path / "top.toml", 'include = ["mid.toml"]\n')
    with pytest.raises(ConfigError, match="included file not found") as err:
        load_job_config(top)
    assert f"{top} → {tmp_path / 'mid.toml'} → {tmp_path / 'nowhere.toml'}" in str(err.value)
    with pytest.raises(ConfigError, match="list of file paths"):
        load_job_config(write(tmp_path / "bad.toml", 'include = "mid.toml"\n'))


def test_validate_config_explains_and_exits_2_on_a_cycle(chain: Path, tmp_path: Path):
    result = forge("validate-config", str(chain), "--explain")
    assert result.returncode == 0, result.stderr
    assert f"n_layers = 4  ← {chain.parent / 'mid/size.toml'}" in result.stdout
    data = json.loads(forge("validate-config", str(chain), "--json").stdout)
    assert data["sources"]["optimizer.weight_decay"] == str(chain) and "include" not in data["config"]
    write(tmp_path / "loop.toml", 'include = ["loop.toml"]\n')
    looped = forge("validate-config", str(tmp_path / "loop.toml"))
    assert looped.returncode == 2 and "include cycle" in looped.stdout + looped.stderr
