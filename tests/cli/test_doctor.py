"""`forge doctor`: the checklist renders, --json is machine-readable, and failures set the exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine import preflight
from engine.preflight import Outcome
from forgecli.app import app

REQUIRED = {"python", "torch", "disk space", "write permission", "gloo process group"}
runner = CliRunner()


def doctor(*args: str):
    return runner.invoke(app, ["doctor", *args], env={"NO_COLOR": "1"})


def test_checklist_passes_here_in_plain_text(tmp_path: Path):
    result = doctor("--dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "\x1b[" not in result.output  # not a terminal: no colour codes
    for name in REQUIRED | {"extra: wandb", "extra: torchao", "slurm"}:
        assert name in result.output
    assert "✓ gloo process group" in result.output
    assert str(tmp_path) in result.output
    assert "ready to train" in result.output.splitlines()[-1]


def test_json_lists_every_check(tmp_path: Path):
    result = doctor("--dir", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    checks = json.loads(result.stdout)
    assert all(set(c) == {"name", "status", "detail", "fix"} for c in checks)
    assert all(c["status"] in {"ok", "warn", "fail", "info"} for c in checks)
    by_name = {c["name"]: c for c in checks}
    assert set(by_name) >= REQUIRED
    assert all(by_name[name]["status"] == "ok" for name in REQUIRED)
    assert by_name["gpu"]["status"] in {"ok", "info", "warn"}  # no GPU is not a failure


def test_required_failure_exits_1_with_a_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setattr(preflight, "check_python", lambda: Outcome("fail", "3.9.0", "use Python >= 3.11"))
    result = doctor("--dir", str(tmp_path))
    assert result.exit_code == 1
    assert "✗ python" in result.output
    assert "fix: use Python >= 3.11" in result.output
    assert "1 required check(s) failed" in result.output


def test_crashing_check_is_a_failure_not_a_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    def broken(directory: Path) -> Outcome:
        raise OSError("disk went away")

    monkeypatch.setattr(preflight, "check_disk", broken)
    result = doctor("--dir", str(tmp_path), "--json")
    assert result.exit_code == 1
    disk = next(c for c in json.loads(result.stdout) if c["name"] == "disk space")
    assert disk["status"] == "fail" and "disk went away" in disk["detail"]


def test_missing_extra_is_only_a_warning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail as if not installed
    monkeypatch.setitem(sys.modules, "torchao", None)
    result = doctor("--dir", str(tmp_path), "--json")
    assert result.exit_code == 0
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    wandb, torchao = checks["extra: wandb"], checks["extra: torchao"]
    assert wandb["status"] == "warn" and "not installed" in wandb["detail"] and "pip install" in wandb["fix"]
    assert torchao["status"] == "warn" and "FP8" in torchao["detail"] and "NF4" in torchao["detail"]
    assert "pip install 'torchao" in torchao["fix"]


def test_unwritable_directory_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    def refuse(**kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")  # what a read-only dir gives a non-root user

    monkeypatch.setattr(preflight.tempfile, "NamedTemporaryFile", refuse)
    result = doctor("--dir", str(tmp_path))
    assert result.exit_code == 1
    assert "✗ write permission" in result.output
    assert "Permission denied" in result.output


def test_writable_check_leaves_nothing_behind(tmp_path: Path):
    assert preflight.check_writable(tmp_path).status == "ok"
    assert list(tmp_path.iterdir()) == []


def test_missing_directory_is_a_usage_error(tmp_path: Path):
    assert doctor("--dir", str(tmp_path / "missing")).exit_code == 2


def test_importing_the_command_does_not_import_torch():
    code = "import sys, forgecli.doctor, engine.preflight; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
