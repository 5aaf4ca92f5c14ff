"""Hostile input cannot delete, overwrite or run anything (issue 45): each section drives `forge` as a user
types it with input someone else prepared, and checks the refusal (exit 2, naming the input) and that nothing
was read, written, deleted or run."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.checkpoint.dcp import COMPLETE, TRAIN_STATE
from engine.checkpoint.verify import CHECKSUMS, file_checksum
from engine.config import load_job_config
from engine.data.embedded import embedded_corpus
from engine.data.loader import open_train_data
from engine.data.remote_shards import fetched_shards
from engine.data.shards import MANIFEST, read_manifest
from engine.safe_paths import UnsafePath
from forgecli.app import app
from tests.conftest import REPO
from tests.helpers.cli import forge
from tests.helpers.data_fixtures import corpus_texts, tokenized, tokenizer_file, write_jsonl
from tests.helpers.remote import Store
from tests.helpers.remote import server as server  # a fixture

# ---- paths read from files ----
# A fetched manifest, a checkpoint's checksums.json and the entries of the Forge cache name files; none of them
# may lead `forge` to read, write or delete anything outside its folder (engine/safe_paths.py).

DEBUG = REPO / "presets" / "debug.toml"
TINY_TRAIN = [
    "--model.dim=32",
    "--model.n_layers=1",
    "--model.n_heads=2",
    "--model.n_kv_heads=1",
    "--train.seq_len=32",
    "--model.max_seq_len=32",
    "--train.batch_size=2",
    "--train.max_steps=2",
    "--eval.enabled=false",
    "--scheduler.warmup_steps=1",
]
PLANTED = b"a file the command must leave alone\n"


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr("engine.data.remote.FIRST_WAIT", 0.01)


@pytest.fixture(scope="module")
def data_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small `forge tokenize` output of a few shards, with its tokenizer beside them."""
    return tokenized(tmp_path_factory.mktemp("hostile-data"), shard_tokens=2000)


def files_under(root: Path, leaving_out: Path) -> dict[str, bytes]:
    """Every file below `root` (but those below `leaving_out`) with its bytes, links as where they lead."""
    return {
        str(p.relative_to(root)): (os.readlink(p).encode() if p.is_symlink() else p.read_bytes())
        for p in sorted(root.rglob("*"))
        if (p.is_file() or p.is_symlink()) and not p.is_relative_to(leaving_out)
    }


def train_on(url: str, tmp_path: Path, cache: Path):
    return CliRunner().invoke(
        app,
        ["train", str(DEBUG), *TINY_TRAIN, f"--data.dataset_path={url}", "--run-dir", str(tmp_path / "run")],
        env={"NO_COLOR": "1", "COLUMNS": "300", "FORGE_CACHE_DIR": str(cache)},
    )


@pytest.mark.parametrize("planted", [True, False], ids=["planted-file", "no-file-there"])
@pytest.mark.parametrize("spelling", ["absolute", "dotdot"])
def test_a_fetched_manifest_naming_a_shard_outside_the_cache_is_refused_touching_nothing(
    tmp_path: Path, data_set: Path, server: str, spelling: str, planted: bool
):
    """Before: the fetch skipped a planted file of that name, found it no shard and deleted it; or wrote the
    server's file outside the cache and trained on it (exit 0)."""
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    if planted:
        (outside / "planted.npy").write_bytes(PLANTED)
    # The entry is cache/remote/<digest>/: three levels up is tmp_path.
    name = str(outside / "planted.npy") if spelling == "absolute" else "../../../outside/planted.npy"
    manifest = json.loads((data_set / MANIFEST).read_text())
    first = manifest["shards"][0]["file"]
    manifest["shards"][0]["file"] = name
    Store.files.update({f"/data/{p.name}": p.read_bytes() for p in data_set.iterdir() if p.is_file()})
    Store.files["/data/manifest.json"] = json.dumps(manifest).encode()
    shard = (data_set / first).read_bytes()  # served under the hostile name too, as a hostile store would
    Store.files.update({f"/data/{name}": shard, os.path.normpath(f"/data/{name}"): shard, name: shard})
    before = files_under(tmp_path, leaving_out=cache)

    result = train_on(f"{server}/data", tmp_path, cache)

    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert f"{server}/data/{MANIFEST} is not a readable manifest" in output, output
    assert f"names {name!r}, which is not a plain file name" in output, output
    assert "Traceback" not in output
    assert files_under(tmp_path, leaving_out=cache) == before  # the planted file intact, nothing new outside
    assert not (tmp_path / "run").exists()
    assert not (cache / "remote").exists()  # refused before the cache is touched


def fake_step(folder: Path, sums: dict[str, str]) -> Path:
    """A checkpoint folder forge eval can resolve (its model.toml and tokenizer beside it) whose one step's
    checksums.json is `sums`: the refusal comes before any weight is read, so it holds no weights."""
    step = folder / "step_1"
    step.mkdir(parents=True)
    shutil.copyfile(DEBUG, folder / "model.toml")
    shutil.copyfile(tokenizer_file(folder / "tok"), folder / "tokenizer.json")
    (step / TRAIN_STATE).write_text(json.dumps({"step": 1}))
    (step / CHECKSUMS).write_text(json.dumps(sums))
    (step / COMPLETE).write_text("")
    return step


@pytest.mark.parametrize("entry", ["/dev/zero", "../../outside/secret", "link-out", "sub/secret"])
def test_a_checksum_list_naming_anything_but_a_file_in_its_folder_is_refused(tmp_path: Path, entry: str):
    """Before: /dev/zero was read for ever (forge checkpoint verify hung); ../../outside/secret and a link out
    of the folder were read and reported as a damaged file (exit 1)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(PLANTED)
    step = fake_step(tmp_path / "ckpt", {entry: file_checksum(outside / "secret")})
    (step / "link-out").symlink_to(outside / "secret")

    result = forge("checkpoint", "verify", str(step), timeout=60)

    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, output
    assert str(step / CHECKSUMS) in output and entry in output, output
    assert "Traceback" not in output


def test_forge_eval_refuses_a_checksum_list_naming_a_device(tmp_path: Path):
    """Before: loading the checkpoint read /dev/zero for ever."""
    step = fake_step(tmp_path / "ckpt", {"/dev/zero": "crc32:00000000"})

    result = forge("eval", str(step), "--data", "embedded:val", timeout=120)

    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, output
    assert f"{step / CHECKSUMS} names '/dev/zero', which is not a plain file name" in output, output
    assert "Traceback" not in output


def fetched_entry(url: str, cache: Path) -> Path:
    """The cache entry of the data set at `url`, fetched (the first fetch says where the entry is)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORGE_CACHE_DIR", str(cache))
        return fetched_shards(url, "data.dataset_path")


def test_a_remote_cache_entry_replaced_by_a_link_is_refused_and_its_target_left_alone(
    tmp_path: Path, data_set: Path, server: str
):
    """Before: the fetch wrote the shards through the link into its target, and deleted its files that
    did not match the manifest."""
    cache, victim = tmp_path / "cache", tmp_path / "victim"
    victim.mkdir()
    Store.files.update({f"/data/{p.name}": p.read_bytes() for p in data_set.iterdir() if p.is_file()})
    (victim / read_manifest(data_set).shards[0].file).write_bytes(PLANTED)  # a shard's name, not that shard
    (victim / "tokenizer.json").write_bytes(PLANTED)
    url = f"{server}/data"
    entry = fetched_entry(url, cache)
    shutil.rmtree(entry)
    entry.symlink_to(victim)
    before = files_under(tmp_path, leaving_out=cache)

    result = train_on(url, tmp_path, cache)

    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert f"the Forge cache entry {entry} is a symbolic link" in output and f"rm {entry};" in output, output
    assert "Traceback" not in output
    assert files_under(tmp_path, leaving_out=cache) == before
    assert not (tmp_path / "run").exists()
    entry.unlink()  # the fix the message gives
    assert fetched_entry(url, cache) == entry and (entry / MANIFEST).is_file() and not entry.is_symlink()


def test_a_cache_lock_replaced_by_a_link_is_refused_and_its_target_never_created(
    tmp_path: Path, data_set: Path, server: str
):
    """Before: opening the lock created the link's target, wherever it pointed."""
    cache = tmp_path / "cache"
    Store.files.update({f"/data/{p.name}": p.read_bytes() for p in data_set.iterdir() if p.is_file()})
    url = f"{server}/data"
    entry = fetched_entry(url, cache)
    shutil.rmtree(entry)
    lock = entry.parent / f"{entry.name}.lock"
    lock.unlink()
    lock.symlink_to(tmp_path / "created-outside")

    result = train_on(url, tmp_path, cache)

    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert f"the Forge cache lock {lock} is a symbolic link" in output, output
    assert not (tmp_path / "created-outside").exists()


def test_the_embedded_corpus_cache_refuses_a_folder_replaced_by_a_link(tmp_path: Path, monkeypatch):
    """Before: the corpus was built into the link's target."""
    cache, victim = tmp_path / "cache", tmp_path / "victim"
    victim.mkdir()
    cache.mkdir()
    (cache / "corpus").symlink_to(victim)
    monkeypatch.setenv("FORGE_CACHE_DIR", str(cache))
    with pytest.raises(UnsafePath, match=f"the Forge cache entry {re.escape(str(cache / 'corpus'))} is a symbolic"):
        embedded_corpus()
    assert not any(victim.iterdir())


def test_a_hub_cache_entry_replaced_by_a_link_is_refused_and_its_target_left_alone(tmp_path: Path, monkeypatch):
    """Before: tokenizing into the entry again deleted every file of the link's target."""
    repo, cache, victim = tmp_path / "repo", tmp_path / "cache", tmp_path / "victim"
    write_jsonl(repo / "data" / "train.jsonl", corpus_texts())
    named = [f"--data.hf_dataset_name={repo}", f"--data.tokenizer_path={tokenizer_file(tmp_path / 'tok')}"]
    overrides = [*TINY_TRAIN, "--model.vocab_size=512", *named]
    with monkeypatch.context() as patch:
        patch.setenv("FORGE_CACHE_DIR", str(cache))
        entry = open_train_data(load_job_config(DEBUG, [o.removeprefix("--") for o in overrides])).directory
    assert entry.parent == cache / "hf"
    shutil.rmtree(entry)
    victim.mkdir()
    (victim / "shard-00000.npy").write_bytes(PLANTED)  # named like a shard: what a rerun clears away
    entry.symlink_to(victim)
    before = files_under(tmp_path, leaving_out=cache)

    result = CliRunner().invoke(
        app,
        ["train", str(DEBUG), *overrides, "--run-dir", str(tmp_path / "run")],
        env={"NO_COLOR": "1", "COLUMNS": "300", "FORGE_CACHE_DIR": str(cache)},
    )

    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert f"the Forge cache entry {entry} is a symbolic link" in output, output
    assert files_under(tmp_path, leaving_out=cache) == before


def test_forge_eval_refuses_dcp_metadata_naming_a_file_outside_the_checkpoint(tmp_path: Path):
    """Before: DCP opened whatever file `.metadata` named for a tensor, `../` included."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    step = fake_step(tmp_path / "ckpt", {})
    (step / CHECKSUMS).unlink()  # a checkpoint from before checksums: loaded unverified, so DCP reads it
    name = "../../outside/secret"
    storage = {MetadataIndex("model.tok_embeddings.weight"): _StorageInfo(name, 0, 8)}
    (step / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={}, storage_data=storage)))

    result = forge("eval", str(step), "--data", "embedded:val", timeout=120)

    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, output
    assert f"{step / '.metadata'} names {name!r}, which is not a plain file name" in output, output


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
