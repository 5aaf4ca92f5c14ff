"""`forge slurm`: the rendered script (golden files, quoting, checks at submit), and, against a real single-node
SLURM cluster (tests/helpers/slurm_cluster.py), preemption → checkpoint → exit 75 → requeue → bitwise resume, status and
logs across attempts, the requeue bound, sweeps as one array job, chains, graceful cancel and injection safety.

The cluster tests are marked `slurm`. Under CI=true they must run: a cluster that cannot start fails them.
Elsewhere they skip, with the reason, on a machine that cannot host the cluster (not root, no apt)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from forgecli.app import app
from tests.conftest import REPO
from tests.helpers.slurm_cluster import Cluster, can_host

GOLDEN = REPO / "tests" / "golden"
# A 2-rank CPU job that takes some seconds: long enough to be signalled mid-run, short enough for 2 cores.
TINY = [
    "--train.seq_len=64",
    "--model.max_seq_len=64",
    "--metrics.log_interval=1",
    "--eval.enabled=false",
    "--scheduler.warmup_steps=3",
    "--train.shutdown_timeout_sec=60",
    "--checkpoint.interval=1000",
]
FAST = ["--signal-lead", "120"]
EVIL = '$(touch pwned)"; touch pwned2 #'
runner = CliRunner()
# One worker runs them all (`make test` passes --dist loadfile), so one session starts one cluster.


@pytest.fixture(autouse=True)
def wide_consoles(monkeypatch):
    """The in-process runs here read whole panels: the CLI's consoles (made without a width) read COLUMNS each
    time they measure, so a wide COLUMNS for each test widens them. Setting `console.width` instead would pin
    it: monkeypatch's undo writes the old width back as a fixed one, and the worker's later tests would all
    get 80 columns whatever COLUMNS they ask for."""
    monkeypatch.setenv("COLUMNS", "200")


def dry_run(*args: str, env: dict | None = None):
    return runner.invoke(
        app,
        ["slurm", "submit", "presets/debug.toml", "--dry-run", *args],
        env={"NO_COLOR": "1", "COLUMNS": "200", **(env or {})},
    )


def placeholders(script: str, run_dir: Path) -> str:
    """The machine-specific paths of a rendered script as names, so the golden files hold on any machine."""
    return (
        script.replace(sys.executable, "{PYTHON}")
        .replace(str(run_dir), "{RUN_DIR}")
        .replace(str(REPO), "{REPO}")
        .replace(str(Path.cwd()), "{CWD}")
    )


GOLDEN_CASES = {
    "slurm_1node.sbatch": ["--ntasks-per-node", "2", "--train.max_steps=20"],
    "slurm_4x8gpu.sbatch": [
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--cpus-per-task",
        "12",
        "--time",
        "24:00:00",
        "--partition",
        "gpu",
        "--account",
        "proj",
        "--qos",
        "high",
        "--max-requeues",
        "5",
        "--sbatch-arg=--exclusive",
        "--distributed.tp=2",
    ],
}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_rendered_script_matches_golden(tmp_path, name):
    run_dir = tmp_path / "run"
    result = dry_run("--run-dir", str(run_dir), *GOLDEN_CASES[name])
    assert result.exit_code == 0, result.output
    rendered = placeholders(result.stdout, run_dir)
    if os.environ.get("FORGE_UPDATE_GOLDEN"):
        (GOLDEN / name).write_text(rendered)
    assert rendered == (GOLDEN / name).read_text()
    assert not run_dir.exists()  # a dry run writes nothing


def test_values_are_quoted_so_the_shell_runs_nothing(tmp_path):
    """The override reaches `forge train` as one word, whatever it holds; bash itself shows it (`printf`)."""
    run_dir = tmp_path / "a dir $(touch pwned3)"
    result = dry_run("--run-dir", str(run_dir), f"--metrics.wandb_run_name={EVIL}", "--job-name", "x'; touch pwned4 #")
    assert result.exit_code == 0, result.output
    body = result.stdout.split("\nmkdir -p")[0]  # the assignments, before anything runs
    shown = subprocess.run(
        ["bash", "-c", body + '\nprintf "%s\\n" "$RUN_DIR" "${OVERRIDES[@]}"'],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert shown == [str(run_dir), f"--metrics.wandb_run_name={EVIL}"]
    assert not list(tmp_path.glob("pwned*"))
    assert "#SBATCH --job-name='x'\"'\"'; touch pwned4 #'" in result.stdout


def test_sweep_renders_one_array_with_a_run_dir_per_point(tmp_path):
    result = dry_run(
        "--run-dir",
        str(tmp_path / "sw"),
        "--sweep",
        "optimizer.lr=1e-3,3e-4",
        "--sweep",
        "train.seed=1,2",
        "--after-ok",
        "77",
        "--after",
        "78",
    )
    assert result.exit_code == 0, result.output
    assert "#SBATCH --array=0-3" in result.stdout
    assert "#SBATCH --dependency=afterany:78,afterok:77" in result.stdout
    assert f"3) RUN_DIR={tmp_path}/sw/lr=3e-4_seed=2; POINT=(--optimizer.lr=3e-4 --train.seed=2) ;;" in result.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--signal-lead", "100"], "--signal-lead 100 s is too short: train.shutdown_timeout_sec = 300 s"),
        (["--ntasks-per-node", "2", "--distributed.tp=4"], "world size"),
        (["--sweep", "optimizer.lr"], "is not section.key=value1,value2"),
    ],
)
def test_bad_submissions_are_refused_before_anything_is_written(tmp_path, args, message):
    result = dry_run("--run-dir", str(tmp_path / "r"), *args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()).replace("│", "").replace("  ", " ") or message in result.output


@pytest.mark.parametrize(
    "lead,timeout,shard,message",
    [
        (600, 300, 200e9, "cannot be saved within the shutdown timeout"),  # 400 s at 500 MB/s
        (420, 300, 100e9, "--signal-lead 420 s is too short"),  # 300 s + 200 s
        (70000, 300, 1e9, "more than SLURM accepts"),
    ],
)
def test_signal_lead_must_cover_the_shutdown_and_the_save(lead, timeout, shard, message):
    from engine.errors import UserError
    from engine.slurm.render import check_signal_lead

    check_signal_lead(600, 300, 1e9)  # the defaults, for a 1 GB shard
    with pytest.raises(UserError, match=message):
        check_signal_lead(lead, timeout, int(shard))


def test_a_run_dir_holding_another_run_is_refused_at_submit(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.toml").write_text((REPO / "presets" / "debug.toml").read_text())
    assert dry_run("--run-dir", str(tmp_path / "r")).exit_code == 0  # the same run: it continues
    result = dry_run("--run-dir", str(tmp_path / "r"), "--model.dim=96")
    assert result.exit_code == 2 and "model.dim" in result.output and "an existing run" in result.output


def test_missing_sbatch_is_a_clear_user_error(tmp_path):
    result = runner.invoke(
        app,
        ["slurm", "submit", "presets/debug.toml", "--run-dir", str(tmp_path / "r")],
        env={"PATH": str(tmp_path), "NO_COLOR": "1", "COLUMNS": "200"},
    )
    assert result.exit_code == 2, result.output
    assert "sbatch not found on PATH" in result.output
    assert not (tmp_path / "r").exists()


# ----- against a real cluster -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    reason = can_host()
    if reason and os.environ.get("CI") != "true":
        pytest.skip(reason)
    started = Cluster(tmp_path_factory.mktemp("slurm")).start()  # under CI a failure here fails the tests
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(started.conf)
    yield started
    started.stop()
    if previous is None:
        os.environ.pop("SLURM_CONF")
    else:
        os.environ["SLURM_CONF"] = previous


def forge(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "forgecli.app", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def submit(*args: str, cwd: Path) -> str:
    result = forge("slurm", "submit", *args, "--json", cwd=cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)["job_id"]


def job(job_id: str) -> dict[str, str]:
    from engine.slurm.jobs import scontrol_job

    return scontrol_job(job_id)


def wait_for(check, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return found


def steps(run_dir: Path) -> dict[int, tuple[float, float]]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    records = [json.loads(line) for line in lines if line.endswith("\n")]
    logged = [r["step"] for r in records if "loss" in r]
    assert len(logged) == len(set(logged)), f"a step was logged twice: {logged}"
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records if "loss" in r}


def finished(job_id: str) -> bool:
    return job(job_id).get("JobState") in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}


def requeued_and_restarted(job_id: str, run_dir: Path) -> None:
    """The job requeues itself, waits out its BeginTime (the test cluster's cred_expire, 10 s) and starts again."""
    wait_for(lambda: job(job_id).get("Reason") == "BeginTime", 90, f"job {job_id} to be requeued")
    wait_for(lambda: "attempt=1 start" in events(run_dir), 90, f"job {job_id} to start again")


def events(run_dir: Path) -> str:
    path = run_dir / "slurm" / "events.log"
    return path.read_text() if path.exists() else ""


def preempt_at(job_id: str, run_dir: Path, step: int) -> None:
    """The preemption signal, to the ranks (as --signal=USR1@lead sends it), once `step` is logged."""
    wait_for(lambda: max(steps(run_dir), default=0) >= step, 120, f"step {step} of job {job_id}")
    assert job(job_id)["JobState"] == "RUNNING", "the job finished before it could be preempted"
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)


def final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    from engine.checkpoint.dcp import latest_checkpoint, load_checkpoint
    from engine.config import load_job_config
    from engine.model.transformer import Transformer

    model = Transformer(load_job_config(run_dir / "config.toml").model)
    latest, path = latest_checkpoint(run_dir / "checkpoints")
    assert latest == step
    load_checkpoint(path, model)
    return model.state_dict()


@pytest.fixture
def evil_preset(tmp_path) -> Path:
    """The debug preset with a run name that would run commands if it ever reached a shell unquoted."""
    text = (REPO / "presets" / "debug.toml").read_text() + f"wandb_run_name = {json.dumps(EVIL)}\n"
    preset = tmp_path / "evil preset.toml"
    preset.write_text(text)
    return preset


@pytest.mark.slurm
def test_preempted_job_requeues_resumes_bitwise_and_is_followed_across_attempts(cluster, tmp_path, evil_preset):
    """A 2-rank gloo job gets USR1 mid-run, checkpoints, exits 75, requeues itself and finishes; its losses and
    weights equal an uninterrupted job's bitwise. Both run from a preset whose run name is a shell injection,
    into run directories with spaces: nothing runs, and the name reaches the run unchanged."""
    args = [str(evil_preset), "--ntasks-per-node", "2", *FAST, *TINY, "--train.max_steps=16"]
    preempted, whole = tmp_path / "pre empted", tmp_path / "who le"
    job_id = submit(*args, "--run-dir", str(preempted), cwd=tmp_path)
    preempt_at(job_id, preempted, 5)
    requeued_and_restarted(job_id, preempted)
    wait_for(lambda: finished(job_id), 150, "the requeued job to finish")
    reference = submit(*args, "--run-dir", str(whole), cwd=tmp_path)
    wait_for(lambda: finished(reference), 150, "the uninterrupted job to finish")

    for run, ran in ((preempted, job_id), (whole, reference)):
        assert job(ran)["JobState"] == "COMPLETED", (run / "slurm" / "output.log").read_text()[-3000:]
    assert steps(preempted) == steps(whole) and len(steps(whole)) == 16
    ours, theirs = final_weights(preempted, 16), final_weights(whole, 16)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)

    status = forge("slurm", "status", str(preempted), cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert "restarts: 1" in status.stdout and "COMPLETED" in status.stdout
    assert "last step: 16" in status.stdout
    assert "requeue (exit 75)" in status.stdout  # the first attempt, from the script's own events
    by_id = json.loads(forge("slurm", "status", job_id, "--json", cwd=tmp_path).stdout)
    assert by_id["run_dir"] == str(preempted) and by_id["restarts"] == 1 and len(by_id["attempts"]) == 2
    log = forge("slurm", "logs", str(preempted), cwd=tmp_path).stdout
    assert f"job {job_id} attempt 0" in log and f"job {job_id} attempt 1" in log
    assert "SIGUSR1 received" in log and "exit 75, requeueing" in log and "resuming after step" in log
    assert log.index("attempt 0") < log.index("exit 75, requeueing") < log.index("attempt 1")

    assert not list(tmp_path.rglob("pwned*"))
    for run in (preempted, whole):
        assert tomllib_load(run / "config.toml")["metrics"]["wandb_run_name"] == EVIL


def tomllib_load(path: Path) -> dict:
    import tomllib

    return tomllib.loads(path.read_text())


@pytest.mark.slurm
def test_a_job_preempted_more_than_max_requeues_stops_with_a_clear_message(cluster, tmp_path):
    run_dir = tmp_path / "bounded"
    job_id = submit(
        "presets/debug.toml",
        "--run-dir",
        str(run_dir),
        "--max-requeues",
        "0",
        *FAST,
        *TINY,
        "--train.max_steps=60",
        cwd=REPO,
    )
    preempt_at(job_id, run_dir, 3)
    wait_for(lambda: finished(job_id), 90, "the job to end")
    assert job(job_id)["Restarts"] == "0" and job(job_id)["ExitCode"] == "75:0"
    log = forge("slurm", "logs", str(run_dir), cwd=tmp_path).stdout
    assert "preempted 1 times, more than --max-requeues 0: not requeued" in log
    assert forge("slurm", "logs", str(run_dir), "-f", cwd=tmp_path).stdout == log  # an ended job: all of it, then done
    status = forge("slurm", "status", str(run_dir), cwd=tmp_path).stdout
    assert "preempted more than --max-requeues times" in status and "restarts: 0" in status
    assert (run_dir / "checkpoints").is_dir()


@pytest.mark.slurm
def test_sweep_is_one_array_job_chained_after_another(cluster, tmp_path):
    """Two points run as tasks of one array job, once the job they wait for has succeeded; each leaves a
    complete run directory with its own value."""
    held = subprocess.run(
        ["sbatch", "--parsable", "--hold", "-o", "/dev/null", "--wrap", "true"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    sweep = tmp_path / "sweep"
    array = submit(
        "presets/debug.toml",
        "--run-dir",
        str(sweep),
        "--sweep",
        "optimizer.lr=1e-3,3e-4",
        "--after-ok",
        held,
        *FAST,
        *TINY,
        "--train.max_steps=3",
        cwd=REPO,
    )
    assert job(array)["Dependency"] == f"afterok:{held}(unfulfilled)" and job(array)["JobState"] == "PENDING"
    subprocess.run(["scontrol", "release", held], check=True)
    for index in (0, 1):
        wait_for(lambda i=index: finished(f"{array}_{i}"), 120, f"array task {index}")
        assert job(f"{array}_{index}")["JobState"] == "COMPLETED"
    for name, lr in (("lr=1e-3", 1e-3), ("lr=3e-4", 3e-4)):
        point = sweep / name
        assert sorted(steps(point)) == [1, 2, 3]
        assert tomllib_load(point / "config.toml")["optimizer"]["lr"] == lr
        assert (point / "checkpoints" / "step_3").is_dir()
        assert "forge train exited 0" in (point / "slurm" / "output.log").read_text()
    assert steps(sweep / "lr=1e-3") != steps(sweep / "lr=3e-4")


@pytest.mark.slurm
def test_graceful_cancel_checkpoints_and_does_not_requeue(cluster, tmp_path):
    run_dir = tmp_path / "cancelled"
    job_id = submit("presets/debug.toml", "--run-dir", str(run_dir), *FAST, *TINY, "--train.max_steps=200", cwd=REPO)
    wait_for(lambda: max(steps(run_dir), default=0) >= 2, 120, "training to start")
    result = forge("slurm", "cancel", str(run_dir), "--graceful", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"job {job_id} saved a checkpoint and stopped" in result.stdout
    assert job(job_id)["Restarts"] == "0"
    assert "stopped on request" in (run_dir / "slurm" / "output.log").read_text()
    assert any((run_dir / "checkpoints").iterdir())


@pytest.mark.slurm
@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_sbatch_test_only_accepts_the_rendered_scripts(cluster, tmp_path, name):
    """sbatch itself parses every directive. The 4-node GPU script is checked with the resources this one-node
    CPU cluster has put on the command line (which overrides the #SBATCH lines)."""
    result = dry_run("--run-dir", str(tmp_path / "r"), *GOLDEN_CASES[name])
    script = tmp_path / "job.sbatch"
    script.write_text(result.stdout)
    fits_here = ["--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=0", "--partition=debug", "--cpus-per-task=1"]
    checked = subprocess.run(
        ["sbatch", "--test-only", *(fits_here if "gpu" in name else []), str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert checked.returncode == 0, checked.stderr
    assert "to start at" in checked.stderr


@pytest.mark.slurm
def test_doctor_reports_the_slurm_tools_and_controller(cluster, tmp_path):
    result = runner.invoke(app, ["doctor", "--dir", str(tmp_path), "--json"], env={"NO_COLOR": "1"})
    check = next(c for c in json.loads(result.stdout) if c["name"] == "slurm")
    assert check["status"] == "ok", check
    assert "slurm-wlm" in check["detail"] or "slurm " in check["detail"]
    assert "controller" in check["detail"] and "UP" in check["detail"]


@pytest.mark.slurm
def test_a_scaling_plan_runs_as_one_array_job(cluster, tmp_path):
    """`forge scale run --slurm`: the plan's points as the tasks of one array job, each training its own config
    into its own run directory to its last step and evaluation; a rerun here then finds nothing left to train."""
    from tests.helpers.scale import TINY

    preset = tmp_path / "tiny.toml"
    preset.write_text(TINY)
    plan_dir = tmp_path / "plan"
    planned = forge(
        "scale", "plan", str(preset), "--budgets", "1.6e10", "--sizes-per-budget", "3", "--span", "2",
        "--tokens-per-param", "0.004", "--out", str(plan_dir), cwd=tmp_path,
    )  # fmt: skip
    assert planned.returncode == 0, planned.stdout + planned.stderr
    result = forge("scale", "run", str(plan_dir), "--slurm", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    submitted = json.loads(result.stdout)
    array = submitted["job_id"]
    points = json.loads((plan_dir / "plan.json").read_text())["points"]
    assert submitted["run_dirs"] == [str((plan_dir / p["run_dir"]).resolve()) for p in points]  # one job, 3 tasks
    for index, point in enumerate(points):
        wait_for(lambda i=index: finished(f"{array}_{i}"), 240, f"array task {index}")
        run_dir = plan_dir / point["run_dir"]
        assert job(f"{array}_{index}")["JobState"] == "COMPLETED", (run_dir / "slurm" / "output.log").read_text()[
            -3000:
        ]
        assert max(steps(run_dir)) == point["max_steps"]
        assert tomllib_load(run_dir / "config.toml")["model"]["dim"] == point["dim"]
        assert '"eval_loss"' in (run_dir / "metrics.jsonl").read_text()
    local = forge("scale", "run", str(plan_dir), cwd=tmp_path)
    assert local.returncode == 0 and local.stdout.count("complete, skipped") == 3, local.stdout + local.stderr


# ----- forge slurm tokenize ----------------------------------------------------------------------------------


def tokenize_inputs(tmp_path: Path) -> tuple[Path, Path]:
    """Nine small .txt documents (three per part) and a tokenizer for them."""
    from tests.helpers.data_fixtures import corpus_texts, tokenizer_file, write_txt

    return write_txt(tmp_path / "in", corpus_texts(9, 600)), tokenizer_file(tmp_path / "tok")


def test_slurm_tokenize_dry_run_shows_the_array_and_the_merge_after_it(tmp_path):
    source, tok = tokenize_inputs(tmp_path)
    out = tmp_path / "data set"
    result = runner.invoke(
        app,
        ["slurm", "tokenize", str(source), "--tokenizer", str(tok), "--num-shards", "3", "--out", str(out),
         "--shard-tokens", "500", "--time", "2:00:00", "--dry-run"],
        env={"NO_COLOR": "1"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    array, merge = ("\n" + result.stdout).split("\n# ---- ")[1:]
    parts = tmp_path / "data set.parts"
    assert array.startswith(f"{parts}/slurm/tokenize.sbatch: submitted with sbatch --parsable tokenize.sbatch")
    assert "#SBATCH --array=0-2\n" in array and "#SBATCH --time=2:00:00\n" in array
    assert (
        f"tokenize {source} --tokenizer {tok} --text-field text --shard-tokens 500 --num-shards 3 "
        f'--shard-index "$INDEX" --out \'{parts}\'/part-"$PART"\n'
    ) in array
    assert "--dependency=afterok:ARRAY_JOB_ID --kill-on-invalid-dep=yes merge.sbatch" in merge.splitlines()[0]
    assert "#SBATCH --array" not in merge
    named = " ".join(f"'{parts}/part-0000{i}'" for i in range(3))
    assert f"tokenize merge {named} --out '{out}'\n" in merge
    assert not parts.exists() and not out.exists()  # a dry run writes nothing


def test_slurm_tokenize_refuses_bad_requests_before_anything_is_written(tmp_path):
    source, tok = tokenize_inputs(tmp_path)
    (tmp_path / "taken").mkdir()
    cases = {
        ("--num-shards", "0", "--tokenizer", str(tok), "--out", str(tmp_path / "o")): "--num-shards",
        ("--num-shards", "2", "--tokenizer", str(tmp_path / "no.json"), "--out", str(tmp_path / "o")): "no.json",
        ("--num-shards", "2", "--tokenizer", str(tok), "--out", str(tmp_path / "taken")): "already exists",
    }
    for args, message in cases.items():
        result = runner.invoke(app, ["slurm", "tokenize", str(source), *args, "--dry-run"], env={"NO_COLOR": "1"})
        assert result.exit_code == 2 and message in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "taken", "tok"]


def test_slurm_tokenize_checks_its_inputs_as_forge_tokenize_does(tmp_path):
    """Inputs that `forge tokenize` refuses (a missing folder, one without documents) are refused before the
    scripts are rendered, not in the parts' logs."""
    _, tok = tokenize_inputs(tmp_path)
    (tmp_path / "no-docs").mkdir()
    (tmp_path / "no-docs" / "notes.md").write_text("not a format forge tokenize reads")
    for given, message in ((tmp_path / "corpus", "not found"), (tmp_path / "no-docs", "no documents found")):
        args = [str(given), "--tokenizer", str(tok), "--num-shards", "2", "--out", str(tmp_path / "o")]
        local = runner.invoke(app, ["tokenize", *args[:3], "--out", str(tmp_path / "o")], env={"NO_COLOR": "1"})
        result = runner.invoke(app, ["slurm", "tokenize", *args, "--dry-run"], env={"NO_COLOR": "1"})
        assert local.exit_code == 2 and message in local.output, local.output
        assert result.exit_code == 2 and message in result.output and "#SBATCH" not in result.output, result.output
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.parts").exists()


def refusing_sbatch(folder: Path) -> dict[str, str]:
    """A PATH whose `sbatch` fails as a cluster refusing the job does (an unknown partition, say)."""
    folder.mkdir()
    sbatch = folder / "sbatch"
    sbatch.write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: nope' >&2\nexit 1\n")
    sbatch.chmod(0o755)
    return {"PATH": f"{folder}:{os.environ['PATH']}", "NO_COLOR": "1", "COLUMNS": "200"}


def test_a_refused_sbatch_leaves_nothing_behind_and_says_what_to_do(tmp_path):
    env = refusing_sbatch(tmp_path / "bin")
    runs = tmp_path / "runs"
    submitted = runner.invoke(
        app,
        ["slurm", "submit", "presets/debug.toml", "--run-dir", str(runs / "lr"), "--sweep", "optimizer.lr=1e-3,3e-4"],
        env=env,
    )
    assert submitted.exit_code == 2, submitted.output
    assert "invalid partition specified" in submitted.output and "nothing was submitted" in submitted.output
    assert not runs.exists()

    source, tok = tokenize_inputs(tmp_path)
    out = tmp_path / "data"
    args = [str(source), "--tokenizer", str(tok), "--num-shards", "2", "--out", str(out)]
    tokenized = runner.invoke(app, ["slurm", "tokenize", *args], env=env)
    assert tokenized.exit_code == 2 and "nothing was submitted" in tokenized.output, tokenized.output
    assert not (tmp_path / "data.parts").exists() and not out.exists()

    from tests.helpers.scale import TINY

    plan = tmp_path / "plan"
    (tmp_path / "tiny.toml").write_text(TINY)
    planned = runner.invoke(
        app,
        ["scale", "plan", str(tmp_path / "tiny.toml"), "--budgets", "1.6e10", "--sizes-per-budget", "3",
         "--span", "2", "--tokens-per-param", "0.004", "--out", str(plan)],
        env=env,
    )  # fmt: skip
    assert planned.exit_code == 0, planned.output
    before = sorted(p.relative_to(plan) for p in plan.rglob("*"))
    scaled = runner.invoke(app, ["scale", "run", str(plan), "--slurm"], env=env)
    assert scaled.exit_code == 2 and "nothing was submitted" in scaled.output, scaled.output
    assert sorted(p.relative_to(plan) for p in plan.rglob("*")) == before


@pytest.mark.slurm
def test_slurm_tokenize_runs_the_parts_and_merges_them(cluster, tmp_path):
    """Three array tasks and the merge job after them leave the data set one process would: the same tokens,
    documents and token counts."""
    from engine.data.shards import read_manifest
    from engine.data.tokenize import tokenize_files
    from tests.helpers.data_fixtures import all_tokens

    source, tok = tokenize_inputs(tmp_path)
    out = tmp_path / "merged"
    result = forge(
        "slurm", "tokenize", str(source), "--tokenizer", str(tok), "--num-shards", "3", "--shard-tokens", "500",
        "--out", str(out), "--json", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = json.loads(result.stdout)
    assert job(jobs["merge_job"])["Dependency"].startswith(f"afterok:{jobs['array_job']}")
    wait_for(lambda: finished(jobs["merge_job"]), 180, "the merge job")
    logs = tmp_path / "merged.parts" / "slurm"
    assert job(jobs["merge_job"])["JobState"] == "COMPLETED", (logs / "merge.log").read_text()
    whole = tokenize_files([source], tmp_path / "whole", tokenizer=tok, shard_tokens=500).manifest
    merged = read_manifest(out)
    assert [read_manifest(tmp_path / "merged.parts" / f"part-0000{i}").total_documents for i in range(3)] == [3, 3, 3]
    assert (merged.total_tokens, merged.total_documents) == (whole.total_tokens, whole.total_documents)
    assert np.array_equal(all_tokens(out), all_tokens(tmp_path / "whole"))
