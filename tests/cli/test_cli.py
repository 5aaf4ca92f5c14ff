"""The CLI end to end, as a user types it: help, validate-config, train, and bad input of every kind."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers.cli import forge

TINY = [
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--train.seq_len=64",
    "--model.max_seq_len=64",
    "--train.batch_size=4",
    "--train.max_steps=6",
    "--metrics.log_interval=1",
    "--eval.interval=3",
    "--eval.steps=2",
    "--checkpoint.interval=3",
    "--scheduler.warmup_steps=2",
]


CPU_USED = "used = resource.getrusage(resource.RUSAGE_SELF)\nsys.stderr.write(f'cpu={used.ru_utime + used.ru_stime}')\n"


def test_help_is_fast_and_lists_commands():
    """`forge --help` must not import torch. Its cost is the child's own CPU seconds (not wall time: the other
    test worker's ranks can hold both cores of a CI machine for the moment it runs), against a reference taken
    the same way in the same test on the same machine: importing torch alone. No fixed number of seconds,
    which a slower CPU would miss; measured 0.25 s for --help and 1.9 s for `import torch` (2 cores, loaded)."""
    code = (
        "import resource, sys\nfrom forgecli.app import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n" + CPU_USED
    )
    best = min(_cpu_seconds([sys.executable, "-c", code, "--help"]) for _ in range(3))
    torch_import = _cpu_seconds([sys.executable, "-c", "import resource, sys, torch\n" + CPU_USED])
    out = forge("--help").stdout
    for command in ("train", "validate-config", "tokenize", "doctor"):
        assert command in out
    assert best < torch_import / 3, f"forge --help took {best:.2f} s of CPU, importing torch {torch_import:.2f} s"


def _cpu_seconds(command: list[str]) -> float:
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False, timeout=30)
    assert result.returncode == 0 and "cpu=" in result.stderr, result.stderr
    return float(result.stderr.rsplit("cpu=", 1)[1])


def test_help_shows_bracketed_words():
    """Rich markup would swallow `[lora]`, `[model]` and `[default: …]` in help texts unless escaped."""
    cases = [
        (["convert", "to-hf"], ["A [lora] run: write one plain model"]),
        (["convert", "from-hf"], ["the [model] section"]),
        (["extract", "run"], ["[default: the model's max_seq_len]", "[default: the newest]", "[default: all]"]),
        (["extract", "compare"], ["[default: DIR_A against itself]", "pip install 'forge-lm[plot]'"]),
        (["eval"], ["[default: each task's own, usually 0]", "[default: the model's max_seq_len, disjoint windows]"]),
    ]
    for command, needles in cases:
        out = " ".join(forge(*command, "--help").stdout.replace("│", " ").split())
        assert all(needle in out for needle in needles), (command, out)


def test_validate_config_never_imports_torch():
    code = (
        "import sys; sys.argv = ['forge', 'validate-config', 'presets/debug.toml', '--json', "
        "'--eval.tasks=[\"forge_next_line\"]'];\n"  # eval.tasks: lm-eval is found, not imported
        "from forgecli.app import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'lm_eval' not in sys.modules, 'lm_eval was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["parameters"]["total"] > 0 and report["tokens_per_step"] == 8 * 256
    assert report["valid"] is True and report["errors"] == []


def test_validate_config_reports_errors_as_a_table():
    result = forge("validate-config", "presets/debug.toml", "--model.n_layrs=3", "--optimizer.lr=-1")
    assert result.returncode == 2
    assert "model.n_layrs" in result.stderr and "model.n_layers" in result.stderr and "optimizer.lr" in result.stderr
    assert "Traceback" not in result.stderr


def test_validate_config_json_reports_errors_on_stdout():
    """--json on an invalid config: the errors as JSON on stdout (shaped like the warnings), exit 2."""
    result = forge("validate-config", "presets/debug.toml", "--model.n_layrs=3", "--optimizer.lr=-1", "--json")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    report = json.loads(result.stdout)
    assert report["valid"] is False and report["warnings"] == [] and len(report["errors"]) == 2
    typo, lr = report["errors"]
    assert typo == {"field": "model.n_layrs", "problem": "unknown key", "hint": "did you mean 'model.n_layers'?"}
    assert lr["field"] == "optimizer.lr" and "greater than 0" in lr["problem"]


def test_validate_config_world_size():
    assert forge("validate-config", "presets/debug.toml", "--distributed.dp_shard=2").returncode == 2
    result = forge("validate-config", "presets/debug.toml", "--distributed.dp_shard=3", "--world-size", "2")
    assert result.returncode == 2 and "does not multiply" in result.stderr


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_train_writes_a_complete_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    result = forge("train", "presets/debug.toml", "--run-dir", str(run_dir), *TINY)
    assert result.returncode == 0, result.stderr
    assert "step 6/6" in result.stdout and "\x1b[" not in result.stdout  # plain lines off a terminal
    records = metrics_of(run_dir)
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [1, 2, 3, 4, 5, 6]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu"):
        assert key in train_records[-1]
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6]
    assert (run_dir / "train.log").read_text().count("step ") >= 6
    assert (run_dir / "tokenizer.json").is_file()
    assert json.loads((run_dir / "tokenizer_config.json").read_text()) == {"eos_token": "<|endoftext|>"}
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_3", "step_6"]
    # The resolved config is a preset: training from it again validates.
    again = forge("validate-config", str(run_dir / "config.toml"))
    assert again.returncode == 0, again.stderr


@pytest.mark.slow
def test_same_seed_gives_bitwise_identical_losses(tmp_path):
    losses = []
    for name in ("a", "b"):
        result = forge("train", "presets/debug.toml", "--run-dir", str(tmp_path / name), *TINY)
        assert result.returncode == 0, result.stderr
        losses.append([(r["step"], r["loss"], r["grad_norm"]) for r in metrics_of(tmp_path / name) if "loss" in r])
    assert losses[0] == losses[1]
    other = forge("train", "presets/debug.toml", "--run-dir", str(tmp_path / "c"), *TINY, "--train.seed=7")
    assert other.returncode == 0
    assert [r["loss"] for r in metrics_of(tmp_path / "c") if "loss" in r] != [loss for _, loss, _ in losses[0]]


def assert_user_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    for needle in needles:
        assert needle in result.stderr, result.stderr


@pytest.mark.parametrize(
    "args,needles",
    [
        (["presets/nope.toml"], ["nope.toml", "not found"]),
        (["presets/debug.toml", "--train.bach_size=2"], ["train.bach_size", "train.batch_size"]),
        (["presets/debug.toml", "--train.batch_size=two"], ["train.batch_size"]),
        (["presets/debug.toml", "--optimizer.lr=-1"], ["optimizer.lr"]),
        (["presets/debug.toml", "--train.seq_len=512"], ["train.seq_len", "max_seq_len"]),
        (["presets/debug.toml", "--data.dataset_path=/no/such/dir", "--eval.enabled=false"], ["/no/such/dir"]),
        (["presets/debug.toml", "--data.dataset_path=/no/such/dir"], ["eval.dataset_path"]),
        (["presets/debug.toml", "--model.vocab_size=1000"], ["vocab"]),
        (["presets/debug.toml", "--distributed.tp=2"], ["does not multiply to the world size 1"]),
        (["presets/debug.toml", "stray"], ["stray"]),
        (["presets/debug.toml", "--model.sdpa_backend=efficient"], ["model.sdpa_backend"]),
        (["presets/debug.toml", "--data.dataset_path=/data/[red]x[/]", "--eval.enabled=false"], ["/data/[red]x[/]"]),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tmp_path, args, needles):
    run_dir = tmp_path / "run"
    result = forge("train", *args, "--run-dir", str(run_dir))
    assert_user_error(result, *needles)
    assert not run_dir.exists()


def test_setup_failures_after_validation_write_nothing(tmp_path):
    """Errors found while starting (a bad environment variable, a sink that cannot start) leave no run behind."""
    run_dir = tmp_path / "run"
    assert_user_error(
        forge("train", "presets/debug.toml", "--run-dir", str(run_dir), FORGE_PEAK_FLOPS="fast"), "FORGE_PEAK_FLOPS"
    )
    assert not run_dir.exists()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_user_error(forge("train", "presets/debug.toml", "--run-dir", str(blocker)), "is a file")
    code = (
        "import sys; sys.modules['torch.utils.tensorboard'] = None; sys.argv = ['forge', *sys.argv[1:]]\n"
        "from forgecli.app import main; main()"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "train",
            "presets/debug.toml",
            "--run-dir",
            str(run_dir),
            "--metrics.enable_tensorboard=true",
            *TINY,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert_user_error(result, "tensorboard")
    assert not run_dir.exists()
    run_dir.mkdir()  # an existing empty folder keeps existing, and stays empty
    result = subprocess.run(
        result.args, cwd=REPO, capture_output=True, text=True, timeout=240, env={**os.environ, "NO_COLOR": "1"}
    )
    assert_user_error(result, "tensorboard")
    assert list(run_dir.iterdir()) == []


def test_json_summary_is_the_only_stdout(tmp_path):
    """...and a config warning (a warmup as long as the run) goes to stderr at the start, not into the JSON."""
    args = ("presets/debug.toml", *TINY, "--scheduler.warmup_steps=6")
    result = forge("train", *args, "--run-dir", str(tmp_path / "run"), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["steps"] == 6 and summary["final_loss"] > 0
    assert "step 6/6" in result.stderr
    assert result.stderr.index("warning: scheduler.warmup_steps") < result.stderr.index("step 6/6")
    checked = forge("validate-config", *args, "--json")
    assert checked.returncode == 0, checked.stderr
    assert [w["field"] for w in json.loads(checked.stdout)["warnings"]] == ["scheduler.warmup_steps"]
    shown = forge("validate-config", *args)
    assert "warning: scheduler.warmup_steps: 6 >= train.max_steps (6)" in " ".join(shown.stdout.split())


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~2 minutes alone; sharing 2 cores with the other test worker, up to twice that
def test_debug_preset_as_the_readme_runs_it(tmp_path):
    """The main job: presets/debug.toml on the embedded corpus, loss from ~ln(vocab) to >= 2 nats below it."""
    result = forge("train", str(REPO / "presets" / "debug.toml"), cwd=tmp_path, timeout=850)  # run dir: runs/debug
    assert result.returncode == 0, result.stderr
    records = [r for r in metrics_of(tmp_path / "runs" / "debug") if "loss" in r]
    first, last = records[0]["loss"], records[-1]["loss"]
    assert records[-1]["step"] == 300
    assert abs(first - math.log(4096)) < 0.3
    assert last <= math.log(4096) - 2.0, f"loss fell only from {first:.2f} to {last:.2f}"


def test_empty_and_corrupt_data_directories(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_user_error(
        forge(
            "train",
            "presets/debug.toml",
            f"--data.dataset_path={empty}",
            "--eval.enabled=false",
            "--run-dir",
            str(tmp_path / "r1"),
        ),
        str(empty),
    )
    assert not (tmp_path / "r1").exists()

    data = tmp_path / "data"
    docs = tmp_path / "docs.txt"
    docs.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    made = forge("tokenize", str(docs), "--out", str(data), "--train-tokenizer", "--vocab-size", "300")
    assert made.returncode == 0, made.stderr
    shard = sorted(data.glob("*.npy"))[0]
    shard.write_bytes(shard.read_bytes()[: len(shard.read_bytes()) // 2])
    assert_user_error(
        forge(
            "train",
            "presets/debug.toml",
            f"--data.dataset_path={data}",
            "--eval.enabled=false",
            "--run-dir",
            str(tmp_path / "r2"),
        ),
        shard.name,
    )
    assert not (tmp_path / "r2").exists()


def test_a_rank_ends_with_the_code_and_output_the_interpreter_would_give(capsys):
    """What `main` passes to `end_process` for a rank of a multi-process run."""
    from forgecli.app import exit_code

    assert exit_code(SystemExit(None)) == 0 and exit_code(SystemExit(75)) == 75
    assert exit_code(SystemExit("cannot go on")) == 1 and "cannot go on" in capsys.readouterr().err
    try:
        raise RuntimeError("a bug in a rank")
    except RuntimeError as failure:
        assert exit_code(failure) == 1
    assert "RuntimeError: a bug in a rank" in capsys.readouterr().err


def test_a_second_process_writing_the_same_run_is_refused_while_the_first_lives(tmp_path):
    """A requeued job or a hand-typed resume while the run still goes: exit 2 naming the holder, nothing
    touched. The lock dies with its process (here SIGKILL), so a crashed run never blocks its resume."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom pathlib import Path\n"
            "from engine.run_lock import RunLock\n"
            "lock = RunLock.acquire(Path(sys.argv[1]))\nprint('held', flush=True)\ntime.sleep(600)",
            str(run_dir),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        result = forge("train", "presets/debug.toml", "--run-dir", str(run_dir), *TINY, "--train.max_steps=2")
        assert_user_error(result, "being written by another forge process", f"pid {holder.pid} on")
        assert [p.name for p in run_dir.iterdir()] == [".forge.lock"]
    finally:
        holder.kill()
        holder.wait(timeout=30)
    result = forge("train", "presets/debug.toml", "--run-dir", str(run_dir), *TINY, "--train.max_steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step_2" / "COMPLETE").exists()
