"""The planning room (engine/plan/): each command resolves its job once, and the imports point one way.

`ResolvedJob` is built only by `engine.plan.resolve`; counting its constructions while a command runs in
process counts the command's resolutions. The import checks read the code (tests/helpers/imports.py), so they
cover lazy imports too."""

from __future__ import annotations

from unittest import mock

import pytest
from typer.testing import CliRunner

from engine.plan.job import ResolvedJob
from forgecli.app import app
from tests.conftest import REPO
from tests.helpers.imports import import_targets
from tests.helpers.runs import TINY
from tests.helpers.scale import TINY as TINY_SCALE_PRESET

ENGINE = REPO / "engine"
# What engine/config/ may import from other rooms: the torch-free modules where components register their
# configuration classes (their fields), which compose JobConfig's sections.
COMPONENT_CONFIGURATION = (
    "engine.train.optim",
    "engine.train.schedule_shapes",
    "engine.data.kinds",
    "engine.metrics.sinks",
    "engine.model.families",
)


def commands(tmp) -> dict[str, list[str]]:
    preset = tmp / "tiny.toml"
    preset.write_text(TINY_SCALE_PRESET)
    return {
        "validate-config": ["validate-config", "presets/debug.toml", "--world-size", "2", "--json"],
        "train": ["train", "presets/debug.toml", *TINY, "--train.max_steps=2", "--run-dir", str(tmp / "run"), "--json"],
        "scale plan": ["scale", "plan", str(preset), "--budgets", "1.6e10,2.5e10", "--sizes-per-budget", "3",
                       "--span", "2", "--tokens-per-param", "0.004", "--out", str(tmp / "plan")],
        "slurm submit": ["slurm", "submit", "presets/debug.toml", "--dry-run", "--run-dir", str(tmp / "sbatch")],
        "init": ["init", str(tmp / "new.toml"), "--defaults"],
    }  # fmt: skip


@pytest.mark.parametrize("name", ["validate-config", "train", "scale plan", "slurm submit", "init"])
def test_each_command_resolves_its_job_once(tmp_path, monkeypatch, name):
    monkeypatch.chdir(REPO)
    made = []
    original = ResolvedJob.__init__

    def counted(self, *args, **kwargs):
        made.append(kwargs.get("world_size"))
        original(self, *args, **kwargs)

    with mock.patch.object(ResolvedJob, "__init__", counted):
        result = CliRunner().invoke(app, commands(tmp_path)[name], env={"NO_COLOR": "1", "COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert len(made) == 1, f"forge {name} resolved its job {len(made)} times"


def foreign_imports(room: str) -> list[tuple[str, int, str]]:
    """(file, line, module) of every import under engine/ROOM/ into another engine room."""
    found = []
    for path in sorted((ENGINE / room).rglob("*.py")):
        for line, module in import_targets(path.read_text(), str(path)):
            parts = module.split(".")
            if parts[0] == "engine" and len(parts) > 2 and parts[1] not in (room, "errors"):
                found.append((str(path.relative_to(REPO)), line, module))
    return found


def test_config_imports_no_rooms_rules_or_implementation():
    """engine/config/ reaches other rooms only for their components' configuration classes: never a rules
    module, the planning room, or an implementation, at module level or lazily."""
    outside = [f for f in foreign_imports("config") if not f[2].startswith(COMPONENT_CONFIGURATION)]
    assert not outside, outside


def test_parallel_imports_nothing_of_training_or_planning():
    """The layouts know nothing of the loop or of how a run's length is planned."""
    found = [f for f in foreign_imports("parallel") if f[2].startswith(("engine.train", "engine.plan"))]
    assert not found, found
