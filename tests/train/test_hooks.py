"""`[[train.hooks]]`: research code from a package on PYTHONPATH, run by `forge train` at its cadence, on the
ranks it declares; a failing hook stops the run with a checkpoint; a bad target is exit 2 before training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers.layouts import GLOBAL_BATCH, TINY
from tests.helpers.torchrun import run_bounded

HOOKS = '''
import json
from pathlib import Path

from engine.train.hooks import TrainingHook


class Recorder(TrainingHook):
    """Appends every call it gets to <out>/<tag>_rank<r>.jsonl."""

    ranks = "all"

    def __init__(self, out, tag):
        self.out, self.tag = Path(out), tag

    def write(self, job, event, step, **extra):
        with open(self.out / f"{self.tag}_rank{job.place.rank}.jsonl", "a") as f:
            f.write(json.dumps({"event": event, "step": step, **extra}) + "\\n")

    def on_step_end(self, step, metrics, job):
        assert metrics["step"] == step and metrics["loss"] > 0
        self.write(job, "step", step)

    def on_eval(self, step, metrics, job):
        self.write(job, "eval", step, eval_loss=metrics["eval_loss"])

    def on_checkpoint(self, step, path, job):
        self.write(job, "checkpoint", step, path=Path(path).name)

    def on_run_end(self, step, metrics, job):
        self.write(job, "end", step, steps=metrics["steps"])


class MainRecorder(Recorder):
    ranks = "main"


class Failing(TrainingHook):
    def __init__(self, at):
        self.at = at

    def on_step_end(self, step, metrics, job):
        if step == self.at:
            raise ValueError("the histogram went wrong")


class NotAHook:
    pass
'''


@pytest.fixture
def hook_path(tmp_path: Path) -> Path:
    package = tmp_path / "pkgs" / "myhooks"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "recording.py").write_text(textwrap.dedent(HOOKS))
    return tmp_path / "pkgs"


def train(run_dir: Path, hook_path: Path, hooks: str, *extra: str, nproc: int = 1) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "NO_COLOR": "1",
        "COLUMNS": "200",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(hook_path), str(REPO)]),
    }
    launch = [f"--nproc-per-node={nproc}"] if nproc > 1 else []
    command = [sys.executable, "-m", "forgecli.app", "train", "presets/debug.toml", "--run-dir", str(run_dir)]
    batch = f"--train.batch_size={GLOBAL_BATCH // nproc}"
    return run_bounded(
        [*command, *TINY, batch, f"--train.hooks={hooks}", *launch, *extra], timeout=240, cwd=REPO, env=env
    )


def calls(path: Path) -> list[tuple[str, int]]:
    return [(r["event"], r["step"]) for r in map(json.loads, path.read_text().splitlines())]


def recorder(tmp_path: Path, cls: str, tag: str, every: int) -> str:
    return f'{{target = "myhooks.recording:{cls}", every = {every}, args = {{out = "{tmp_path}", tag = "{tag}"}}}}'


def test_a_hook_runs_at_its_cadence_and_call_points(tmp_path, hook_path):
    result = train(tmp_path / "run", hook_path, f"[{recorder(tmp_path, 'Recorder', 'rec', 2)}]")
    assert result.returncode == 0, result.stderr
    assert calls(tmp_path / "rec_rank0.jsonl") == [
        ("step", 2),
        ("eval", 3),
        ("checkpoint", 3),
        ("step", 4),
        ("eval", 6),
        ("step", 6),
        ("checkpoint", 6),
        ("end", 6),
    ]
    config = (tmp_path / "run" / "config.toml").read_text()
    assert "[[train.hooks]]" in config and "myhooks.recording:Recorder" in config


def test_a_hook_that_cannot_be_built_stops_before_training(tmp_path, hook_path):
    result = train(tmp_path / "run", hook_path, '[{target = "myhooks.recording:Recorder", args = {out = 1, tag = 2}}]')
    assert result.returncode == 1, result.stderr
    out = result.stdout + result.stderr
    assert "train.hooks[0] (myhooks.recording:Recorder) failed in __init__" in out and "Traceback" not in out
    assert not (tmp_path / "run").exists()


def test_a_failing_hook_stops_the_run_with_a_checkpoint(tmp_path, hook_path):
    run_dir = tmp_path / "run"
    result = train(run_dir, hook_path, '[{target = "myhooks.recording:Failing", args = {at = 4}}]')
    assert result.returncode == 1, result.stderr
    out = result.stdout + result.stderr
    assert "train.hooks[0] (myhooks.recording:Failing) failed in on_step_end at step 4" in out
    assert "ValueError: the histogram went wrong" in out and "Traceback" not in out
    assert (run_dir / "checkpoints" / "step_4" / "COMPLETE").is_file()
    assert not (run_dir / "checkpoints" / "step_5").exists()


@pytest.mark.parametrize(
    "hooks,field,problem",
    [
        ('[{target = "myhooks.nowhere:X"}]', "train.hooks[0].target", "does not import"),
        ('[{target = "myhooks.recording:NotAHook"}]', "train.hooks[0].target", "not a subclass"),
        ('[{target = "myhooks.recording:Failing", args = {when = 3}}]', "train.hooks[0].args", "arguments"),
    ],
)
def test_a_bad_hook_is_exit_2_before_training(tmp_path, hook_path, hooks, field, problem):
    result = train(tmp_path / "run", hook_path, hooks)
    assert result.returncode == 2, result.stderr
    out = " ".join((result.stdout + result.stderr).split())
    assert field in out and problem in out
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_hooks_run_on_the_ranks_they_declare_and_each_rank_keeps_its_profile(tmp_path, hook_path):
    """The 2-process run also profiles steps 2-4 (`[profiling]`): each rank exports its own trace, both kept
    (one shared name had one rank's export replace or break the other's)."""
    hooks = f"[{recorder(tmp_path, 'Recorder', 'all', 3)}, {recorder(tmp_path, 'MainRecorder', 'main', 2)}]"
    profiling = ["--profiling.enable=true", "--profiling.start_step=2", "--profiling.end_step=4"]
    result = train(tmp_path / "run", hook_path, hooks, *profiling, nproc=2)
    assert result.returncode == 0, result.stderr
    traces = sorted((tmp_path / "run" / "profile").iterdir())
    assert [p.name for p in traces] == ["trace_steps_2-4_rank0.json", "trace_steps_2-4_rank1.json"]
    for trace in traces:  # whole JSON, each with the profiled steps' events
        events = json.loads(trace.read_text())["traceEvents"]
        assert any(e.get("name") == "aten::mm" for e in events), trace.name
        assert json.loads(trace.read_text())["distributedInfo"]["rank"] == int(trace.stem[-1]), trace.name
    assert sorted(p.name for p in tmp_path.glob("*.jsonl")) == [
        "all_rank0.jsonl",
        "all_rank1.jsonl",
        "main_rank0.jsonl",
    ]
    every_rank = [("eval", 3), ("step", 3), ("checkpoint", 3), ("eval", 6), ("step", 6), ("checkpoint", 6), ("end", 6)]
    assert calls(tmp_path / "all_rank0.jsonl") == calls(tmp_path / "all_rank1.jsonl") == every_rank
    assert [c for c in calls(tmp_path / "main_rank0.jsonl") if c[0] == "step"] == [
        ("step", 2),
        ("step", 4),
        ("step", 6),
    ]


@pytest.mark.slow
def test_a_hook_failing_on_rank_0_only_stops_every_rank_with_a_checkpoint(tmp_path, hook_path):
    """Failing runs on rank 0 only (the default `ranks = "main"`): rank 1 learns of it and stops too."""
    run_dir = tmp_path / "run"
    result = train(run_dir, hook_path, '[{target = "myhooks.recording:Failing", args = {at = 4}}]', nproc=2)
    assert result.returncode == 1, result.stderr
    assert "failed in on_step_end at step 4" in result.stdout + result.stderr
    assert (run_dir / "checkpoints" / "step_4" / "COMPLETE").is_file()


def test_validate_config_finds_hook_modules_without_importing_them(hook_path):
    """validate-config looks for the module (a missing one is exit 2) but never imports it: importing research
    code is what training does. So a class that is not a hook is found only by forge train."""
    from tests.helpers.cli import forge

    path = os.pathsep.join([str(hook_path), str(REPO)])
    (hook_path / "myhooks" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    found = forge(
        "validate-config",
        "presets/debug.toml",
        '--train.hooks=[{target = "myhooks.recording:NotAHook"}]',
        PYTHONPATH=path,
    )
    assert found.returncode == 0, found.stdout + found.stderr
    missing = forge(
        "validate-config", "presets/debug.toml", '--train.hooks=[{target = "myhooks.nowhere:X"}]', PYTHONPATH=path
    )
    out = " ".join((missing.stdout + missing.stderr).split())
    assert missing.returncode == 2 and "train.hooks[0].target" in out and "PYTHONPATH" in out


def test_hooks_may_change_on_resume():
    """A hook that stopped a run can be fixed or dropped when the run resumes: hooks change nothing computed."""
    from engine.config import load_job_config
    from engine.config.changes import resume_issues

    saved = load_job_config(None, ['--train.hooks=[{target = "a.b:C"}]'])
    assert resume_issues(saved, load_job_config(None, ["--train.hooks=[]"])) == []
