"""Hostile input cannot delete, overwrite or run anything (issue 45): each section drives `forge` as a user
types it with input someone else prepared, and checks the refusal (exit 2, naming the input) and that nothing
was read, written, deleted or run."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from safetensors import safe_open
from typer.testing import CliRunner

from engine.checkpoint.dcp import COMPLETE, TRAIN_STATE
from engine.checkpoint.verify import CHECKSUMS, file_checksum
from engine.config import load_job_config
from engine.config.loader import dump_toml
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
from tests.helpers.runs import TINY as TINY_ARGS
from tests.helpers.runs import forge as forge_subprocess
from tests.helpers.scale import TINY as TINY_STUDY

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


def squeezed(text: str) -> str:
    """`text` without whitespace and box-drawing characters: a long path that Rich wraps inside a panel or a
    table cell reads whole again."""
    return re.sub(r"[\s\u2500-\u257f]", "", text)


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
    assert str(step / CHECKSUMS) in squeezed(output) and entry in output, output
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


@pytest.mark.parametrize("entry", ["absolute", "../outside/model.safetensors", "/dev/zero"])
def test_an_hf_index_naming_a_file_outside_its_folder_is_refused(tmp_path: Path, entry: str):
    """Before: `forge convert from-hf` opened every file a model.safetensors.index.json's weight_map named,
    wherever it was, and imported an outside file's weights (exit 0)."""
    from engine.checkpoint.hf import export_to_hf
    from tests.helpers.convert import make_run, model_config, random_model

    hf = tmp_path / "hf"
    export_to_hf(make_run(tmp_path / "run", random_model(model_config(dim=32, n_layers=1, n_heads=2))), hf)
    (tmp_path / "outside").mkdir()
    moved = (hf / "model.safetensors").rename(tmp_path / "outside" / "model.safetensors")
    name = str(moved) if entry == "absolute" else entry
    with safe_open(moved, "pt") as weights:
        index = {"metadata": {}, "weight_map": dict.fromkeys(weights.keys(), name)}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    before = files_under(tmp_path, leaving_out=tmp_path / "nothing")

    result = run_forge("convert", "from-hf", str(hf), "--out", str(tmp_path / "ckpt"))

    assert_refused(result, "model.safetensors.index.json names", "which is not a plain file name")
    assert not (tmp_path / "ckpt").exists() and files_under(tmp_path, tmp_path / "nothing") == before


@pytest.mark.parametrize("entry", ["/dev/zero", "../outside/shard-00000.safetensors", "tokens-link"])
def test_an_extract_manifest_naming_a_shard_outside_its_folder_is_refused(tmp_path: Path, entry: str):
    """Before: `load_activations` (and `forge extract compare`) opened whatever the manifest's shard list
    named, a device included (reading /dev/zero never ends)."""
    from engine.interp import load_activations
    from engine.interp.store import FORMAT, MANIFEST, TOKENS

    acts, outside = tmp_path / "acts", tmp_path / "outside"
    acts.mkdir()
    outside.mkdir()
    (outside / "secret").write_bytes(PLANTED)
    if entry == "tokens-link":  # a link where the token stream belongs, leading out of the folder
        (acts / TOKENS).symlink_to(outside / "secret")
        shards = []
    else:
        shards = [entry]
    manifest = {"format": FORMAT, "version": 1, "columns": [], "storage": "shards", "shards": shards}
    (acts / MANIFEST).write_text(json.dumps(manifest))

    with pytest.raises(UnsafePath, match=r"which is not a plain file name|symbolic link leading out"):
        load_activations(acts)
    result = run_forge("extract", "compare", str(acts))
    assert_refused(result, str(acts / MANIFEST))
    assert (outside / "secret").read_bytes() == PLANTED


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


def test_slurm_submit_of_a_saved_config_naming_code_needs_allow_code(tmp_path):
    """Before: `forge slurm submit RUN/config.toml` rendered and submitted a job whose `forge train` then
    refused the saved hook in the job's log (or, with a hand-edited script, ran it). Now the submission is
    refused the same way `forge train` refuses it, and --allow-code reaches the job's command line."""
    run = handed_over_run(tmp_path / "run", HOOKS_TOML)
    before = snapshot(run)
    args = ["slurm", "submit", str(run / "config.toml"), "--run-dir", str(tmp_path / "job"), "--dry-run"]
    refused = forge(*args, **ROOT_PATH)
    out = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode == 2, out
    assert "train.hooks[0].target" in out and "--allow-code" in out and "#!/bin/bash" not in out
    assert snapshot(run) == before and not (tmp_path / "job").exists() and not (run / "RAN").exists()

    allowed = forge(*args, "--allow-code", **ROOT_PATH)
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    (train_line,) = [line for line in allowed.stdout.splitlines() if "-m forgecli.app train" in line]
    assert '--run-dir "$RUN_DIR" --allow-code' in train_line
    assert not (run / "RAN").exists()  # submitting imports nothing either way


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
    # Wide enough that the error table's cell holds the whole temporary path (off a terminal Rich still cuts
    # a cell to the width: issue 57's piped tables).
    result = forge(*args, '--train.hooks=[{target = "evil:Hook"}]', cwd=run, COLUMNS="1000", **ROOT_PATH)
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, out
    assert "train.hooks[0].target" in out and "--allow-code" in out
    assert f"{run / 'evil.py'}," in squeezed(out), out
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


# ---- bad input exits 2 ----


def run_forge(*args: str):
    """`forge ARGS` in this process, its stdout and stderr apart."""
    return CliRunner().invoke(app, list(args), env={"NO_COLOR": "1", "COLUMNS": "200"})


def one_line(text: str) -> str:
    """A panel's text on one line (Rich wraps long messages inside the box)."""
    return " ".join(text.translate(str.maketrans("│╭╮╰╯─", "      ")).split())


def assert_refused(result, *named: str) -> None:
    """Exit code 2, every `named` string in the message, and no traceback."""
    output = result.stdout + result.stderr
    assert result.exit_code == 2, (output, result.exception)
    assert "Traceback" not in output
    for name in named:
        assert name in one_line(result.stderr), result.stderr


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` and its bytes: equal before and after a refused command means it wrote nothing."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def finished_study(root: Path) -> list[Path]:
    """Six run directories that look finished (config, a final held-out loss, an attempt that ended complete)
    without training them: `forge scale fit` reads nothing else."""
    (root / "tiny.toml").write_text(TINY_STUDY)
    runs = []
    for i, dim in enumerate([64, 128, 192, 64, 128, 192]):
        cfg = load_job_config(root / "tiny.toml", [f"--model.dim={dim}", f"--train.max_steps={10 + 10 * i}"])
        run = root / f"run{i}"
        run.mkdir()
        (run / "config.toml").write_text(dump_toml(cfg))
        steps = cfg.train.max_steps
        logged = [
            {"step": steps, "loss": 3.0, "tokens_seen": 128 * steps},
            {"step": steps, "eval_loss": 3 + 1 / (i + 1)},
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged))
        ended = [{"event": "start", "time": time.time()}, {"event": "end", "reason": "complete", "time": time.time()}]
        (run / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ended))
        runs.append(run)
    return runs


def test_a_finished_study_fits(tmp_path):
    """The study the bad inputs below are made from fits as it is: each refusal is the input's doing."""
    result = run_forge("scale", "fit", *map(str, finished_study(tmp_path)), "--bootstrap", "10")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("eval_loss", ["NaN", "Infinity", "-1.0", '"low"', "null"])
def test_scale_fit_refuses_a_final_loss_that_is_not_a_positive_number(tmp_path, eval_loss):
    runs = finished_study(tmp_path)
    metrics = runs[2] / "metrics.jsonl"
    train, evaluated = metrics.read_text().splitlines()
    evaluated = f'{{"step": {json.loads(evaluated)["step"]}, "eval_loss": {eval_loss}}}'  # JSON as Python writes NaN
    metrics.write_text(f"{train}\n{evaluated}\n")
    before = tree(tmp_path)
    result = run_forge("scale", "fit", *map(str, runs), "--bootstrap", "10", "--plot", str(tmp_path / "fit.png"))
    assert_refused(result, str(metrics), f"the final eval_loss is {eval_loss}")
    assert tree(tmp_path) == before


def test_scale_fit_names_a_run_config_that_is_not_utf8(tmp_path):
    runs = finished_study(tmp_path)
    (runs[4] / "config.toml").write_bytes(b"\xff\xfe[model]\n")
    before = tree(tmp_path)
    assert_refused(run_forge("scale", "fit", *map(str, runs), "--bootstrap", "10"), f"{runs[4]}/config.toml", "UTF-8")
    assert tree(tmp_path) == before


def plan_folder(root: Path) -> Path:
    (root / "tiny.toml").write_text(TINY_STUDY)
    plan = root / "plan"
    made = run_forge(
        "scale", "plan", str(root / "tiny.toml"), "--budgets", "1.6e10,2.5e10", "--sizes-per-budget", "3",
        "--span", "2", "--tokens-per-param", "0.004", "--out", str(plan),
    )  # fmt: skip
    assert made.exit_code == 0, made.output
    return plan


def edit_plan(change):
    def edit(plan: dict):
        change(plan)
        return plan

    return edit


@pytest.mark.parametrize(
    "change,named",
    [
        (edit_plan(lambda p: p.update(points=[])), "has no points"),
        (edit_plan(lambda p: p.pop("points")), "points is missing"),
        (edit_plan(lambda p: p["points"][1].update(max_steps="52")), 'points[1].max_steps = "52" is not of type int'),
        (edit_plan(lambda p: p["points"][0].update(extra=1)), "points[0].extra is not a field of a plan"),
        (lambda p: p["points"], "the plan is not a JSON object"),
        (edit_plan(lambda p: p["points"][0].update(run_dir="../victim")), 'run_dir = "../victim" is not runs/NAME'),
        (edit_plan(lambda p: p["points"][0].update(run_dir="/tmp/victim")), "is not runs/NAME inside the plan"),
        (edit_plan(lambda p: p["points"][2].update(run_dir="runs/../../x")), "'../../x', which is not a plain file"),
        (edit_plan(lambda p: p["points"][1].update(config="/etc/hostname")), 'config = "/etc/hostname" is not'),
        (edit_plan(lambda p: p["points"][1].update(config="configs/../../x.toml")), "which is not a plain file"),
    ],
)
def test_scale_fit_names_what_is_wrong_with_a_plan(tmp_path, change, named):
    plan = plan_folder(tmp_path)
    (plan / "plan.json").write_text(json.dumps(change(json.loads((plan / "plan.json").read_text()))))
    before = tree(tmp_path)
    assert_refused(run_forge("scale", "fit", str(plan), "--bootstrap", "10"), f"{plan}/plan.json", named)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("run_dir", ["../victim", "runs/../../victim"])
def test_scale_run_never_trains_outside_its_plan(tmp_path, run_dir):
    """Before: a plan.json edited to put a point's run elsewhere had `forge scale run` train (and write a
    run directory) there."""
    plan = plan_folder(tmp_path)
    raw = json.loads((plan / "plan.json").read_text())
    raw["points"][0]["run_dir"] = run_dir
    (plan / "plan.json").write_text(json.dumps(raw))
    before = tree(tmp_path)
    assert_refused(run_forge("scale", "run", str(plan)), f"{plan}/plan.json", "points[0].run_dir")
    assert tree(tmp_path) == before and not (tmp_path / "victim").exists()


def test_scale_fit_of_a_plan_with_no_run_started_says_so(tmp_path):
    plan = plan_folder(tmp_path)
    assert_refused(run_forge("scale", "fit", str(plan), "--bootstrap", "10"), "needs at least 6 finished runs", "got 0")


@pytest.mark.parametrize("tokens", ["nan", "inf", "-inf", "0.5"])
def test_scale_fit_refuses_a_token_count_that_is_not_one(tmp_path, tokens):
    runs = finished_study(tmp_path)
    before = tree(tmp_path)
    plot = tmp_path / "fit.png"
    args = ["--predict", str(tmp_path / "tiny.toml"), "--tokens", tokens, "--plot", str(plot), "--bootstrap", "10"]
    assert_refused(run_forge("scale", "fit", *map(str, runs), *args), f"--tokens {tokens}", "positive, finite")
    assert tree(tmp_path) == before


def test_runs_lists_an_unreadable_run_with_its_problem_and_the_others_as_usual(tmp_path):
    runs = finished_study(tmp_path)
    (runs[1] / "config.toml").write_bytes(b"[train]\nmax_steps = \xff\n")
    (runs[3] / "config.toml").write_text("[train\n")
    before = tree(tmp_path)
    result = run_forge("runs", str(tmp_path), "--json")
    assert result.exit_code == 0, (result.output, result.exception)
    listed = {run["name"]: run for run in json.loads(result.stdout)}
    assert sorted(listed) == [run.name for run in runs]
    assert listed["run1"]["status"] == "unreadable" and "config.toml is not UTF-8" in listed["run1"]["detail"]
    assert listed["run3"]["status"] == "unreadable" and "config.toml is not valid TOML" in listed["run3"]["detail"]
    assert all(listed[f"run{i}"]["status"] == "complete" for i in (0, 2, 4, 5))
    shown = run_forge("runs", str(tmp_path))
    assert shown.exit_code == 0 and "unreadable" in shown.stdout and "Traceback" not in shown.output
    assert tree(tmp_path) == before


@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory) -> Path:
    """Four steps of a tiny model, with a checkpoint at the last."""
    run = tmp_path_factory.mktemp("trained") / "run"
    args = [*TINY_ARGS, "--train.max_steps=4", "--checkpoint.interval=4", "--eval.enabled=false"]
    result = forge_subprocess("train", "presets/debug.toml", "--run-dir", str(run), *args)
    assert result.returncode == 0, result.stderr
    return run


@pytest.mark.parametrize(
    "change,named",
    [
        (list, "holds a JSON list"),
        (lambda state: {"step": 4}, "has no 'tokens_seen'"),
        (lambda state: {**state, "step": "four"}, "'step' is \"four\", not int"),
        (lambda state: {**state, "scheduler": [1]}, "'scheduler' is [1], not dict"),
        (lambda state: {**state, "tokens_seen": -3}, "'tokens_seen' is -3, not a count"),
    ],
)
def test_resume_names_a_train_state_of_the_wrong_shape(checkpointed_run, tmp_path, change, named):
    """The file's checksum is made to match, as when the file was written so: only its content is wrong."""
    run = tmp_path / "run"
    shutil.copytree(checkpointed_run, run)
    step = run / "checkpoints" / "step_4"
    state = step / "train_state.json"
    state.write_text(json.dumps(change(json.loads(state.read_text()))))
    sums = json.loads((step / "checksums.json").read_text())
    (step / "checksums.json").write_text(json.dumps({**sums, "train_state.json": file_checksum(state)}))
    before = tree(run)
    assert_refused(run_forge("resume", str(run), "--train.max_steps=6"), str(state), named)
    assert tree(run) == before


@pytest.mark.parametrize(
    "task,named",
    [
        ("task: [unclosed\n  : :\n", "is not YAML"),
        ('task: nodata\noutput_type: loglikelihood\ndoc_to_text: "{{a}}"\n', "names no data set"),
        ("- task: one\n- task: two\n", "got list"),
    ],
)
def test_eval_names_a_task_file_it_cannot_build_a_task_from(checkpointed_run, tmp_path, task, named):
    task_file = tmp_path / "task.yaml"
    task_file.write_text(task)
    before = tree(checkpointed_run)
    assert_refused(run_forge("eval", str(checkpointed_run), "--tasks", str(task_file)), f"task file {task_file}", named)
    assert tree(checkpointed_run) == before


def to_dev_full(monkeypatch, module, name_part: str) -> None:
    """`module`'s open() of a file whose name holds `name_part` for writing opens /dev/full instead, where
    every write that reaches the disk fails with ENOSPC, as on a full disk."""
    real_open = open

    def full_open(path, mode="r", *args, **kwargs):
        wanted = "w" in mode or "a" in mode
        return real_open("/dev/full" if wanted and name_part in str(path) else path, mode, *args, **kwargs)

    monkeypatch.setattr(module, "open", full_open, raising=False)


def assert_disk_full(result, path: Path) -> None:
    """Exit code 1 (the machine's doing, as for a checkpoint that cannot be written), one line naming the
    file, no traceback."""
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    assert "Traceback" not in result.stdout + result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and said[0].startswith(f"error: no space left on the disk writing {path}:"), result.stderr


def test_a_full_disk_while_writing_metrics_stops_training_with_one_line(tmp_path, monkeypatch):
    from engine.metrics.trackers import JsonlSink

    opened = JsonlSink.__init__

    def on_full_disk(self, path, resumed_from):
        opened(self, path, resumed_from)
        self.file.close()
        self.file = open("/dev/full", "a", encoding="utf-8")  # noqa: SIM115 (the sink closes it)

    monkeypatch.setattr(JsonlSink, "__init__", on_full_disk)
    run = tmp_path / "run"
    args = [*TINY_ARGS, "--train.max_steps=4", "--eval.enabled=false"]
    assert_disk_full(run_forge("train", "presets/debug.toml", "--run-dir", str(run), *args), run / "metrics.jsonl")
    ended = [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines()][-1]
    assert ended["event"] == "end" and ended["reason"] == "failed" and "no space left" in ended["error"]


def test_a_full_disk_while_tokenizing_stops_with_one_line(tmp_path, monkeypatch):
    import engine.durable

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text((REPO / "README.md").read_text()[:20000])
    to_dev_full(monkeypatch, engine.durable, ".npy.")  # a shard's temporary file
    out = tmp_path / "out"
    result = run_forge("tokenize", str(texts), "--train-tokenizer", "--vocab-size", "300", "--out", str(out))
    assert_disk_full(result, out / "shard-00000.npy")
    assert not list(out.glob("*.npy*"))


@pytest.mark.parametrize(
    "command",
    [
        ["tokenize", "TEXTS", "--train-tokenizer", "--vocab-size", "300", "--out", "OUT"],
        ["init", "OUT", "--defaults"],
        ["extract", "RUN", "--layers", "layers.0", "--text", "ROMEO: hello", "--out", "OUT"],
    ],
    ids=["tokenize", "init", "extract"],
)
@pytest.mark.parametrize("inside", [False, True], ids=["the-file", "under-the-file"])
def test_an_output_path_at_or_under_a_regular_file_is_refused(checkpointed_run, tmp_path, command, inside):
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text((REPO / "README.md").read_text()[:5000])
    blocker = tmp_path / "blocker"
    blocker.write_text("mine\n")
    out = blocker / "out" if inside else blocker
    named = {"TEXTS": str(texts), "OUT": str(out), "RUN": str(checkpointed_run)}
    before, run_before = tree(tmp_path), tree(checkpointed_run)
    result = run_forge(*[named.get(arg, arg) for arg in command])
    if inside:
        assert_refused(result, str(out), f"is inside {blocker}, which is a file")
    elif command[0] == "init":
        assert_refused(result, str(out), "already exists")
    else:
        assert_refused(result, f"--out {out} is a file")
    assert tree(tmp_path) == before and tree(checkpointed_run) == run_before


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_init_force_replaces_only_a_regular_file(tmp_path, kind):
    """Not tried on /dev/full itself: before the fix, the rename would have replaced the machine's device."""
    target = tmp_path / "preset.toml"
    kept = tmp_path / "kept.toml"
    kept.write_text("mine\n")
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to(kept)
    assert_refused(run_forge("init", str(target), "--defaults", "--force"), f"PRESET {target} is", "regular files")
    assert (target.is_fifo() if kind == "fifo" else target.is_symlink()) and kept.read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.toml", "preset.toml"]


@pytest.mark.parametrize(
    "command,named",
    [
        (["generate", "RUN", "--prompt", "ROMEO:", "--max-new-tokens", "4", "--temperature", "nan"], "--temperature nan"),
        (["generate", "RUN", "--prompt", "ROMEO:", "--max-new-tokens", "4", "--temperature", "inf"], "--temperature inf"),
        (["extract", "RUN", "--layers", "layers.0", "--text", "ROMEO:", "--out", "OUT", "--shard-mb", "nan"], "--shard-mb nan"),
        (["extract", "RUN", "--layers", "layers.0", "--text", "ROMEO:", "--out", "OUT", "--shard-mb", "inf"], "--shard-mb inf"),
    ],
)  # fmt: skip
def test_a_number_option_that_is_not_finite_is_refused(checkpointed_run, tmp_path, command, named):
    named_paths = {"RUN": str(checkpointed_run), "OUT": str(tmp_path / "out")}
    before = tree(checkpointed_run)
    assert_refused(run_forge(*[named_paths.get(arg, arg) for arg in command]), named)
    assert tree(checkpointed_run) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "override,limit",
    [
        ("--model.max_seq_len=1e12", "16777216"),
        ("--model.dim=1e9", "1048576"),
        ("--model.vocab_size=1e12", "16777216"),
        ("--train.batch_size=1e12", "1048576"),
    ],
)
def test_a_size_beyond_its_bound_is_refused_by_name_before_training(tmp_path, override, limit):
    """Sizes that validation took and the allocation then failed on."""
    run = tmp_path / "run"
    result = run_forge("train", "presets/debug.toml", *TINY_ARGS, override, "--run-dir", str(run))
    assert_refused(result, override.split("=")[0].removeprefix("--"), f"less than or equal to {limit}")
    assert not run.exists()


@pytest.mark.parametrize(
    "override,limit",
    [
        ("--train.max_steps=1000000000000000000000000000000", "1000000000000"),
        ("--train.max_tokens=1000000000000000000000000000000", "1000000000000000000"),
    ],
)
def test_a_run_length_beyond_its_bound_is_refused_by_name(override, limit):
    """Checked by validate-config: before the bound, training took the length and went on for ever."""
    result = run_forge("validate-config", "presets/debug.toml", override)
    assert_refused(result, override.split("=")[0].removeprefix("--"), f"less than or equal to {limit}")
