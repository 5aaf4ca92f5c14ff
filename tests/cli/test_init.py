"""`forge init`: the preset it writes from prompts, --defaults and --from validates, trains, and says in comments
what each field does and which values were derived."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import tomlkit
from typer.testing import CliRunner

from engine.config import load_job_config
from engine.plan import check_config
from engine.plan.writer import InitAnswers, answers_from, build_preset, with_budget
from forgecli import init as init_command
from forgecli.app import app
from tests.conftest import REPO

DEBUG = REPO / "presets" / "debug.toml"
DEBUG_MOE = REPO / "presets" / "debug_moe.toml"


def forge_init(*args: str, answers: list[str] | None = None):
    return CliRunner().invoke(app, ["init", *args], input="\n".join(answers) + "\n" if answers is not None else None)


def train(preset: Path, run_dir: Path, *overrides: str) -> dict:
    """`forge train PRESET --train.max_steps=2` in a subprocess; its JSON summary."""
    env = {**os.environ, "NO_COLOR": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "forgecli.app",
            "train",
            str(preset),
            "--run-dir",
            str(run_dir),
            "--train.max_steps=2",
            "--json",
            *overrides,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_defaults_write_a_commented_preset_that_validates_and_trains(tmp_path):
    out = tmp_path / "mine.toml"
    result = forge_init(str(out), "--defaults")
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output and "parameters (total)" in result.output and "Estimated memory" in result.output
    text = out.read_text()
    assert "# hidden size\ndim = 192" in text and f"forge train {out}" in text
    assert check_config(load_job_config(out), 1).model_dump() == load_job_config(DEBUG).model_dump()
    summary = train(out, tmp_path / "run", "--scheduler.warmup_steps=1")  # the preset's 20 exceed 2 steps
    assert summary["steps"] == 2 and summary["final_loss"] > 0


def test_prompts_write_what_was_answered_and_mark_what_was_derived(tmp_path, monkeypatch):
    """Custom dims, MoE, fp32, lion, a token budget: the answers land in the file, the derived values say so,
    and the preset trains."""
    monkeypatch.setattr(init_command, "stdin_is_terminal", lambda: True)
    out = tmp_path / "moe_lion.toml"
    answers = ["custom", "64", "2", "4", "y", "embedded", "1", "1", "fp32", "lion", "40k"]
    result = forge_init(str(out), answers=answers)
    assert result.exit_code == 0, result.output
    assert "Model size" in result.output and "Optimizer" in result.output
    cfg = check_config(load_job_config(out), 1)
    assert (cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.num_experts) == (64, 2, 4, 8)
    assert cfg.train.mixed_precision == "fp32" and cfg.optimizer.name == "lion"
    assert cfg.optimizer.lr == pytest.approx(2e-3 / 3, rel=1e-2) and cfg.optimizer.weight_decay == pytest.approx(0.3)
    per_step = 8 * 256
    assert cfg.train.max_steps == -(-40_000 // per_step) == 20 and cfg.scheduler.warmup_steps == 2
    doc = tomlkit.parse(out.read_text())
    assert "derived:" in doc["train"]["max_steps"].trivia.comment
    assert "derived:" in doc["optimizer"]["lr"].trivia.comment and "derived" not in doc["model"]["dim"].trivia.comment
    summary = train(out, tmp_path / "run")
    assert summary["steps"] == 2 and summary["final_loss"] > 0


def test_wrong_answers_are_asked_again(tmp_path, monkeypatch):
    monkeypatch.setattr(init_command, "stdin_is_terminal", lambda: True)
    out = tmp_path / "p.toml"
    answers = ["tiny", "debug", "n", "embedded", "0", "2", "1", "auto", "adamw", "soon", "1.5e5 tokens"]
    result = forge_init(str(out), answers=answers)
    assert result.exit_code == 0, result.output
    assert "must be at least 1" in result.output and "neither a number of steps" in result.output
    cfg = check_config(load_job_config(out), 2)
    assert cfg.train.max_steps == -(-150_000 // (8 * 256 * 2)) and cfg.distributed.dp_shard == -1
    assert "--nproc-per-node 2" in out.read_text()


def test_from_preset_is_a_commented_copy(tmp_path):
    out = tmp_path / "copy.toml"
    assert forge_init(str(out), "--from", str(DEBUG_MOE)).exit_code == 0
    assert load_job_config(out).model_dump() == load_job_config(DEBUG_MOE).model_dump()
    assert "# routed experts per MoE block; 0 = dense model\nnum_experts = 8" in out.read_text()


def test_from_keeps_every_field_of_its_preset(tmp_path):
    """A preset far from the defaults (Hugging Face data and eval, lion, wsd, HSDP × TP over 8 ranks, a long
    warmup) comes back field for field, checked for the world size its layout implies."""
    rich = tmp_path / "rich.toml"
    rich.write_text(
        DEBUG.read_text()
        .replace("warmup_steps = 20", "warmup_steps = 200")
        .replace('name = "cosine"', 'name = "wsd"\nstable_steps = 50\ndecay_steps = 40')
        .replace('name = "adamw"\nlr = 2e-3', 'name = "lion"\nlr = 1e-4')
        + """
[data]
hf_dataset_name = "roneneldan/TinyStories"
hf_dataset_config = "default"
hf_dataset_split = "train[:1%]"
hf_dataset_text_field = "story"
hf_streaming = true
tokenizer_path = "tok/tokenizer.json"

[distributed]
dp_replicate = 2
dp_shard = 2
tp = 2
"""
    )
    rich.write_text(
        rich.read_text().replace("[eval]\nenabled = true", '[eval]\nenabled = true\nhf_dataset_name = "x/y"')
    )
    out = tmp_path / "copy.toml"
    result = forge_init(str(out), "--from", str(rich))
    assert result.exit_code == 0, result.output
    assert check_config(load_job_config(out), 8).model_dump() == check_config(load_job_config(rich), 8).model_dump()
    cfg = load_job_config(out)
    assert (cfg.optimizer.name, cfg.scheduler.name, cfg.scheduler.warmup_steps, cfg.eval.hf_dataset_name) == (
        "lion",
        "wsd",
        200,
        "x/y",
    )
    assert "world size 8" in result.output and "derived: 2 nodes" in out.read_text()


def test_no_terminal_no_overwrite(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a short path: the error panel does not wrap it
    out = Path("p.toml")
    result = forge_init(str(out))  # CliRunner's stdin is not a terminal
    assert result.exit_code == 2 and "not a terminal" in result.output and "--defaults" in result.output
    assert not out.exists()
    out.write_text("# mine\n")
    result = forge_init(str(out), "--defaults")
    assert result.exit_code == 2 and "already exists" in result.output and out.read_text() == "# mine\n"
    assert forge_init(str(out), "--defaults", "--force").exit_code == 0 and "[model]" in out.read_text()
    result = forge_init(".", "--defaults", "--force")
    assert result.exit_code == 2 and "is a directory" in result.output
    assert forge_init("new/dir/p.toml", "--defaults").exit_code == 0 and Path("new/dir/p.toml").is_file()


def test_a_closed_stdin_in_a_subprocess_is_an_error_not_a_hang(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "forgecli.app", "init", str(tmp_path / "p.toml")],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 2 and "not a terminal" in result.stderr


def test_layout_and_budget_for_several_nodes():
    """Two nodes of 8 GPUs: a sharded replica per node, and the token budget divided by the global batch."""
    answers = with_budget(InitAnswers(base=DEBUG, gpus_per_node=8, nodes=2), "1B")
    written = build_preset(answers, "big.toml")
    d = written.config.distributed
    assert (d.dp_replicate, d.dp_shard, written.world_size) == (2, 8, 16)
    assert written.config.train.max_steps == -(-(10**9) // (8 * 256 * 16))
    assert "distributed.dp_replicate" in written.derived and "torchrun or srun" in written.text


@pytest.mark.parametrize(
    "answers,expected",
    [
        (InitAnswers(base=DEBUG_MOE, moe=False), {"model.num_experts": 0, "model.moe_router": "softmax_topk"}),
        (
            InitAnswers(base=DEBUG, optimizer="schedule_free_adamw"),
            {"scheduler.name": "constant", "optimizer.schedule_free_warmup_steps": 20, "scheduler.warmup_steps": 0},
        ),
        (
            InitAnswers(base=DEBUG, data="shards", dataset_path="data/shards"),
            {"data.dataset_path": "data/shards", "eval.enabled": False},
        ),
        (
            InitAnswers(base=DEBUG, data="hf", hf_dataset_name="roneneldan/TinyStories", tokenizer_path="tok.json"),
            {
                "data.hf_dataset_name": "roneneldan/TinyStories",
                "data.tokenizer_path": "tok.json",
                "eval.enabled": False,
            },
        ),
    ],
)
def test_answers_that_change_other_fields(answers, expected):
    """Going dense drops the MoE fields, schedule-free takes the constant schedule, own data turns off
    evaluation until held-out data is named: each written preset validates."""
    cfg = build_preset(answers).config
    for path, value in expected.items():
        section, key = path.split(".")
        assert getattr(getattr(cfg, section), key) == value, path


def test_budget_text():
    base = InitAnswers()
    assert with_budget(base, "300").max_steps == 300
    assert with_budget(base, "50M").tokens == 50_000_000 and with_budget(base, "2b tokens").tokens == 2 * 10**9
    with pytest.raises(ValueError):
        with_budget(base, "soon")


def test_prompts_on_a_real_terminal(tmp_path):
    """Through a pseudo-terminal, as a user types: every prompt is answered with Enter (the defaults)."""
    out = tmp_path / "tty.toml"
    main, follower = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "forgecli.app", "init", str(out)],
        cwd=REPO,
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    os.close(follower)
    seen, deadline = b"", time.monotonic() + 60
    while process.poll() is None and time.monotonic() < deadline:
        if select.select([main], [], [], 0.2)[0]:
            try:
                chunk = os.read(main, 4096)
            except OSError:
                break
            seen += chunk
            if chunk.rstrip().endswith(b":"):  # a prompt waits for its answer
                os.write(main, b"\n")
    process.wait(timeout=10)
    os.close(main)
    assert process.returncode == 0, seen.decode(errors="replace")[-2000:]
    assert check_config(load_job_config(out), 1).model_dump() == load_job_config(DEBUG).model_dump()


def test_a_changed_optimizer_trains(tmp_path):
    """schedule_free_adamw on the MoE preset: the constant schedule and the moved warmup it brings along train."""
    out = tmp_path / "sf.toml"
    answers = replace(answers_from(DEBUG_MOE), optimizer="schedule_free_adamw", max_steps=2)
    out.write_text(build_preset(answers).text)
    cfg = load_job_config(out)
    assert (cfg.model.num_experts, cfg.scheduler.name, cfg.optimizer.schedule_free_warmup_steps) == (8, "constant", 0)
    summary = train(out, tmp_path / "run")
    assert summary["steps"] == 2 and summary["final_loss"] > 0
