"""Shell completion: preset paths for PRESET arguments, and `--section.key=value` overrides from the schema,
through the callbacks and through the environment protocol the installed shell scripts use."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.config import JobConfig
from forgecli.completion import complete_override, complete_preset
from tests.conftest import REPO


def values(items) -> list[str]:
    return [item.value for item in items]


def test_preset_paths(tmp_path, monkeypatch):
    (tmp_path / "presets").mkdir()
    for name in ("presets/a.toml", "presets/b.toml", "presets/notes.txt", "top.toml", ".hidden.toml"):
        (tmp_path / name).write_text("")
    monkeypatch.chdir(tmp_path)
    assert complete_preset("") == ["presets/", "top.toml"]
    assert complete_preset("presets/") == ["presets/a.toml", "presets/b.toml"]
    assert complete_preset("presets/b") == ["presets/b.toml"]
    assert complete_preset("nowhere/") == []


def test_override_names_cover_the_schema():
    every = values(complete_override("--", []))
    expected = [
        f"--{section}.{key}="
        for section, info in JobConfig.model_fields.items()
        for key in info.annotation.model_fields
    ]
    assert every == expected
    assert values(complete_override("--model.n_", [])) == [
        "--model.n_layers=",
        "--model.n_heads=",
        "--model.n_kv_heads=",
    ]
    assert complete_override("--model.n_l", [])[0].help == "number of transformer blocks"
    assert complete_override("plain", []) == []


@pytest.mark.parametrize(
    "args,incomplete,expected",
    [
        (["--train.mixed_precision"], "", ["auto", "bf16", "fp16", "fp32", "fp8"]),
        (["--train.mixed_precision"], "fp", ["fp16", "fp32", "fp8"]),
        (["--train.mixed_precision", "="], "b", ["bf16"]),  # bash splits --key=value at the "="
        (["--model.tie_embeddings"], "", ["true", "false"]),
        (["--model.dim"], "", []),  # a number: nothing to offer
    ],
)
def test_override_values(args, incomplete, expected):
    assert values(complete_override(incomplete, args)) == expected


def complete(words: str, **env: str) -> list[str]:
    """What the bash script Typer installs would be told, for the command line `words` (cursor at the end)."""
    cword = len(words.split()) - (0 if words.endswith(" ") else 1)
    code = "from forgecli.app import app\napp(prog_name='forge')\n"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **os.environ,
            "PYTHONPATH": str(REPO),
            "_FORGE_COMPLETE": "complete_bash",
            "COMP_WORDS": words,
            "COMP_CWORD": str(cword),
            **env,
        },
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_bash_protocol():
    assert complete("forge train presets/deb") == ["presets/debug.toml", "presets/debug_moe.toml"]
    # every preset whose name starts so (deepseek_v3_small.toml too), in order
    starting = sorted(f"presets/{p.name}" for p in (REPO / "presets").glob("de*.toml"))
    assert len(starting) >= 3 and complete("forge train presets/de") == starting
    assert complete("forge validate-config presets/debug.toml --model.moe_top_") == ["--model.moe_top_k="]
    assert complete("forge validate-config presets/debug.toml --model.moe_to") == [
        "--model.moe_top_k=",
        "--model.moe_topk_group=",
    ]
    assert complete("forge train presets/debug.toml --train.loss_fn ") == ["cross_entropy", "chunked_cross_entropy"]
    assert "--run-dir" in complete("forge train presets/debug.toml --r")
    assert complete("forge resume runs/x --optimizer.mu") == [
        "--optimizer.muon_momentum=",
        "--optimizer.muon_ns_steps=",
        "--optimizer.muon_adam_lr=",
    ]
    assert "init" in complete("forge in")
    assert complete("forge init mine.toml --from presets/debug_") == ["presets/debug_moe.toml"]


def test_help_offers_completion_install():
    result = subprocess.run(
        [sys.executable, "-m", "forgecli.app", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO), "NO_COLOR": "1", "COLUMNS": "200"},
    )
    assert "--install-completion" in result.stdout and "--show-completion" in result.stdout
