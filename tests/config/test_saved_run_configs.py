"""Run directories written before the model families owned their `[model]` fields (issue 46) still resume.

tests/golden/run_configs/ holds the `config.toml` two runs saved at the commit before that change (`forge train` of
presets/debug.toml at a tiny size for 2 steps; gpt2.toml: the same with `model_type = "gpt2"` and no n_kv_heads):
every field of every family, the ones the run's family does not read at their defaults. They must load as the same
config (saved again byte for byte as they were, but for the fields added since, at their defaults), and a run directory holding one must resume: `forge resume` reads
the saved config, and the run goes on from its checkpoint.

Made with (at the commit before; gpt2_debug.toml is presets/debug.toml with `n_kv_heads = 2` replaced by
`model_type = "gpt2"`):

    forge train presets/debug.toml --model.dim=64 --model.n_layers=2 --model.n_heads=4 --model.n_kv_heads=2 \
        --train.seq_len=64 --model.max_seq_len=64 --train.batch_size=4 --train.max_steps=2 \
        --checkpoint.interval=2 --eval.enabled=false --metrics.log_interval=1 --scheduler.warmup_steps=1 --run-dir RUN
    forge train gpt2_debug.toml (the same overrides but n_kv_heads) --run-dir RUN2
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.config.loader import dump_toml, load_job_config
from engine.plan import check_config
from tests.conftest import REPO

GOLDEN = REPO / "tests" / "golden" / "run_configs"
SAVED = sorted(GOLDEN.glob("*.toml"))


def test_both_families_have_a_saved_config():
    assert [path.stem for path in SAVED] == ["gpt2", "transformer"]


# Fields added to the schema after these files were saved (the issue that added them), each with the default an
# old run gets: saving such a config again writes them too, and nothing else changes.
ADDED_SINCE = {
    "attention_output_gate = false",  # issue 51
    "attention_sinks = false",  # issue 51
}


@pytest.mark.parametrize("saved", SAVED, ids=lambda path: path.stem)
def test_a_config_saved_before_loads_and_saves_again_as_it_was(saved):
    cfg = check_config(load_job_config(saved), 1)
    assert cfg.model.model_type == saved.stem
    again = dump_toml(cfg).splitlines(keepends=True)
    assert {line.strip() for line in again} >= ADDED_SINCE
    assert "".join(line for line in again if line.strip() not in ADDED_SINCE) == saved.read_text()


@pytest.mark.parametrize("saved", SAVED, ids=lambda path: path.stem)
def test_a_run_directory_with_a_config_saved_before_resumes(saved, tmp_path):
    """Train 2 steps from the saved config (which is what the old run trained), put the old file in the run
    directory, and resume it for 2 more: the first 2 steps' records are kept and steps 3 and 4 train."""
    from engine.train.run_dir import run_config
    from engine.train.trainer import train

    run_dir = tmp_path / "run"
    train(load_job_config(saved), run_dir)
    shutil.copyfile(saved, run_dir / "config.toml")
    first = losses(run_dir)
    assert sorted(first) == [1, 2]
    train(run_config(run_dir, ["--train.max_steps=4"]), run_dir)
    after = losses(run_dir)
    assert sorted(after) == [1, 2, 3, 4]
    assert {step: after[step] for step in first} == first


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}
