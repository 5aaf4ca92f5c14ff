"""Hostile input cannot delete, overwrite or run anything (issue 45): each section drives `forge` as a user
types it with input someone else prepared, and checks the refusal (exit 2, naming the input) and that nothing
was read, written, deleted or run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers.cli import forge

# ---- run directories ----
# A run directory handed over by someone else: its saved config.toml may name code (hook modules, task files
# beside it), checkpoint folders outside it, and its folder name ends up in sbatch scripts.

TINY_RUN = [
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--train.seq_len=64",
    "--model.max_seq_len=64",
    "--train.batch_size=4",
    "--eval.interval=50",
    "--eval.steps=1",
    "--scheduler.warmup_steps=1",
]
# Imported, it leaves a file beside itself: what the tests look for to know that it ran.
EVIL_HOOK = """\
from pathlib import Path

Path(__file__).with_name("RAN").write_text("imported")


class Hook:  # not a TrainingHook: a run that imports it stops with exit 2 right after the import
    pass
"""


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes (symlinks as their target), to show that nothing changed; not
    the run lock's file, which says who last took the lock (a refused command takes it, then writes nothing)."""
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.name == ".forge.lock":
            continue
        if path.is_symlink():
            files[str(path.relative_to(folder))] = os.readlink(path).encode()
        elif path.is_file():
            files[str(path.relative_to(folder))] = path.read_bytes()
    return files


def handed_over_run(folder: Path, extra_toml: str) -> Path:
    """A run directory as someone else could hand it over: debug's config saved with `extra_toml` appended, a
    metrics.jsonl (so it reads as a run forge train wrote), and the hook module `evil.py` beside them."""
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text((REPO / "presets" / "debug.toml").read_text() + extra_toml)
    (folder / "metrics.jsonl").write_text("")
    (folder / "evil.py").write_text(EVIL_HOOK)
    return folder


HOOKS_TOML = '\n[[train.hooks]]\ntarget = "evil:Hook"\n'
ROOT_PATH = {"PYTHONPATH": str(REPO)}  # forge itself importable from any working directory


def test_resume_runs_no_hook_named_by_the_saved_config(tmp_path):
    """`forge resume` from inside the run directory: `python -m` puts the working directory first on sys.path,
    so `evil:Hook` would import the run's evil.py. Refused before anything is imported or written."""
    run = handed_over_run(tmp_path / "run", HOOKS_TOML)
    before = snapshot(run)
    result = forge("resume", str(run), *TINY_RUN, cwd=run, **ROOT_PATH)
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, out
    assert "train.hooks[0].target" in out and "--allow-code" in out and "Traceback" not in out
    assert not (run / "RAN").exists()
    assert snapshot(run) == before


def test_resume_with_allow_code_imports_the_saved_hook(tmp_path):
    """The user asks on the command line: then the saved hook is imported (and found not to be a hook)."""
    run = handed_over_run(tmp_path / "run", HOOKS_TOML)
    result = forge("resume", str(run), "--allow-code", *TINY_RUN, cwd=run, **ROOT_PATH)
    assert result.returncode == 2 and "not a subclass" in result.stdout + result.stderr
    assert (run / "RAN").exists()


def test_training_from_a_saved_config_runs_no_task_file_of_it(tmp_path):
    """`forge train RUN/config.toml`: an eval.tasks YAML beside it (lm-eval's `!function` imports the Python
    file next to a task file) is refused; the user's own --eval.tasks would be theirs to choose."""
    run = handed_over_run(tmp_path / "run", "")
    saved = (run / "config.toml").read_text()  # debug's [eval] is enabled
    (run / "config.toml").write_text(saved.replace("[eval]\n", f'[eval]\ntasks = ["{run / "quiz.yaml"}"]\n'))
    (run / "quiz.yaml").write_text("task: quiz\n")
    result = forge("train", str(run / "config.toml"), "--run-dir", str(tmp_path / "mine"), *TINY_RUN)
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, out
    assert "eval.tasks[0]" in out and "--allow-code" in out
    assert not (tmp_path / "mine").exists()


def test_validate_config_names_hooks_without_importing_them(tmp_path):
    run = handed_over_run(tmp_path / "run", HOOKS_TOML)
    result = forge("validate-config", str(run / "config.toml"), cwd=run, **ROOT_PATH)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "evil:Hook" in result.stdout
    assert not (run / "RAN").exists()


def test_a_hook_module_inside_a_run_directory_is_refused_even_when_named_on_the_command_line(tmp_path):
    """Training elsewhere with the working directory in a run directory: a hook target that resolves to a
    module in that run directory (shadowing the user's package, say) is not imported without --allow-code."""
    run = handed_over_run(tmp_path / "run", "")
    args = ["train", str(REPO / "presets" / "debug.toml"), "--run-dir", str(tmp_path / "mine"), *TINY_RUN]
    result = forge(*args, '--train.hooks=[{target = "evil:Hook"}]', cwd=run, **ROOT_PATH)
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, out
    assert "train.hooks[0].target" in out and f"{run / 'evil.py'}," in out and "--allow-code" in out
    assert not (run / "RAN").exists() and not (tmp_path / "mine").exists()


def fake_finished_run(folder: Path) -> Path:
    """Another run's folder with complete checkpoints step_10 and step_20 and its `latest`."""
    (folder / "config.toml").parent.mkdir(parents=True)
    (folder / "config.toml").write_text((REPO / "presets" / "debug.toml").read_text())
    for step in (10, 20):
        (folder / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (folder / "checkpoints" / f"step_{step}" / "COMPLETE").write_text("")
        (folder / "checkpoints" / f"step_{step}" / "weights").write_text(f"the other run's step {step}")
    (folder / "checkpoints" / "latest").write_text("step_20")
    return folder


@pytest.mark.parametrize("spelling", ["relative", "absolute", "symlink"])
def test_a_checkpoint_dir_in_another_run_is_refused(tmp_path, spelling):
    other = fake_finished_run(tmp_path / "other_run")
    mine = tmp_path / "mine"
    checkpoint_dir = {"relative": "../other_run/checkpoints", "absolute": str(other / "checkpoints")}.get(spelling)
    if spelling == "symlink":  # a folder inside the run directory that leads out of it
        mine.mkdir()
        (mine / "ckpt").symlink_to(other / "checkpoints")
        checkpoint_dir = "ckpt"
    before = snapshot(other)
    args = ["train", "presets/debug.toml", "--run-dir", str(mine), *TINY_RUN, "--train.max_steps=2"]
    result = forge(*args, "--checkpoint.interval=1", f"--checkpoint.dir={checkpoint_dir}")
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, out
    assert "checkpoint.dir" in out and "Traceback" not in out
    assert snapshot(other) == before
    if spelling == "symlink":
        assert [p.name for p in mine.iterdir()] == ["ckpt"]
    else:
        assert not mine.exists()


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A run of 4 steps with complete checkpoints at steps 2 and 4 (each test works on a copy)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    args = ["train", "presets/debug.toml", "--run-dir", str(run), *TINY_RUN, "--train.max_steps=4"]
    result = forge(*args, "--checkpoint.interval=2", "--metrics.log_interval=1")
    assert result.returncode == 0, result.stdout + result.stderr
    return run


def copy_of(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run", symlinks=True))


def test_a_complete_checkpoint_is_never_deleted_for_a_new_one_of_its_step(tmp_path, trained_run):
    """Its step_4 damaged, the run resumes from step_2 and saves step_4 again: the complete step_4 that was
    there is set aside, not deleted."""
    run = copy_of(trained_run, tmp_path)
    shard = next((run / "checkpoints" / "step_4").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-16])
    damaged = snapshot(run / "checkpoints" / "step_4")
    result = forge("resume", str(run))
    assert result.returncode == 0, result.stdout + result.stderr
    assert (run / "checkpoints" / "step_4" / "COMPLETE").is_file()
    assert snapshot(run / "checkpoints" / "step_4.superseded-1") == damaged
    assert (run / "checkpoints" / "latest").read_text() == "step_4"


def test_a_refused_resume_leaves_the_saved_config_as_it_was(tmp_path, trained_run):
    """A corrupt metrics.jsonl refuses the resume (exit 2): config.toml must not say the new max_steps, or
    `forge runs` and the next resume would read a target this run never took."""
    run = copy_of(trained_run, tmp_path)
    with (run / "metrics.jsonl").open("a") as metrics:
        metrics.write("not a record\n")
    before = snapshot(run)
    result = forge("resume", str(run), "--train.max_steps=8")
    assert result.returncode == 2 and "metrics.jsonl" in result.stdout + result.stderr
    assert snapshot(run) == before
    listed = forge("runs", str(tmp_path), "--json")
    assert [row["max_steps"] for row in json.loads(listed.stdout)] == [4], listed.stdout


def newline_folder(tmp_path: Path) -> Path:
    """A working directory whose name, rendered unquoted into `#SBATCH --chdir`, would run a command."""
    folder = tmp_path / "work\ntouch PWNED"
    folder.mkdir()
    return folder


def test_slurm_submit_refuses_a_working_directory_with_a_line_break(tmp_path):
    workdir = newline_folder(tmp_path)
    args = ["slurm", "submit", str(REPO / "presets" / "debug.toml"), "--nodes", "1", "--gpus-per-node", "1"]
    result = forge(*args, "--run-dir", str(tmp_path / "run"), "--dry-run", cwd=workdir, **ROOT_PATH)
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, out
    assert "#SBATCH --chdir" in out and "working directory" in out and "#!/bin/bash" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == [workdir.name]


def test_slurm_tokenize_refuses_a_working_directory_with_a_line_break(tmp_path):
    from tests.helpers.data_fixtures import corpus_texts, tokenizer_file, write_txt

    source, tokenizer = write_txt(tmp_path / "in", corpus_texts(3, 600)), tokenizer_file(tmp_path / "tok")
    workdir = newline_folder(tmp_path)
    args = ["slurm", "tokenize", str(source), "--tokenizer", str(tokenizer), "--num-shards", "2"]
    result = forge(*args, "--out", str(tmp_path / "out"), "--dry-run", cwd=workdir, **ROOT_PATH)
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, out
    assert "#SBATCH --chdir" in out and "#!/bin/bash" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["in", "tok", workdir.name])
