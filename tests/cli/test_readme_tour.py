"""README.md's "A short tour", typed in order by a new user in a fresh folder (its `presets/` beside it, as in a
clone) after `make train`: every local command exits as it should, with no traceback.

Each `forge` line of the tour is either run — as written, training cut short by the substitutions below — or
skipped for a stated reason (it needs the network, SLURM, someone else's run, or would edit the shell's
startup files). A line the table does not know fails the test, so a new tour line gets a decision here.
`make train` (runs/debug, which the tour's later commands read) is stood in for by a 4-step run."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO
from tests.helpers.data_fixtures import corpus_texts, write_txt

# Lines not run here, by a piece of their text, and why.
SKIPPED = {
    "runs/theirs": "someone else's run directory: the tour's point is the flag, tested in tests/cli",
    "hf:HuggingFaceFW": "downloads from the Hugging Face Hub",
    "--data.hf_dataset_name": "streams from the Hugging Face Hub",
    "s3://": "reads an S3 bucket",
    "forge slurm tokenize": "submits to SLURM (tests/slurm runs it on a real one)",
    "--sweep": "submits to SLURM",
    "forge slurm status": "needs a submitted job",
    "forge slurm logs": "needs a submitted job",
    "forge slurm cancel": "needs a submitted job",
    "forge scale run": "submits to SLURM (tests/slurm runs it on a real one)",
    "--install-completion": "edits the shell's startup files",
}
# Shorter training, by substitution in the line's text: (what, by what).
SHORTER = [
    ("forge init my_run.toml", "forge init my_run.toml --defaults"),  # the questions' defaults, no terminal
    ("--train.max_steps=50", "--train.max_steps=3"),
    ("--train.max_steps=100", "--train.max_steps=5"),
    (
        "--train.global_batch_size=64 --train.batch_ramp_start=16 --train.batch_ramp_steps=30 --train.max_epochs=1",
        "--train.global_batch_size=32 --train.batch_ramp_start=16 --train.batch_ramp_steps=2 --train.max_steps=3",
    ),
    ("--run-dir runs/fsdp2", "--run-dir runs/fsdp2 --train.max_steps=2"),
    ("--run-dir runs/my_texts", "--run-dir runs/my_texts --train.max_steps=2"),
    ("forge train presets/mixture_debug.toml", "forge train presets/mixture_debug.toml --train.max_steps=6 "
     "--data.anneal_start_step=4"),
    ("--tasks forge_next_line", "--tasks forge_next_line --limit 8"),
    ("--data embedded:val", "--data embedded:val --max-tokens 4000"),
]  # fmt: skip
# Lines that must exit 2: the fit of a study whose runs have not run (issue 57: it named none and crashed).
EXIT_2 = {"forge scale fit": "have not finished: studies/125m/runs/C1e18_N30.2M (not started"}


def tour_lines() -> list[str]:
    """The tour block's commands, continuation lines joined, comments cut."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("## A short tour", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    block = block.replace("\\\n", " ")
    lines = []
    for raw in block.splitlines():
        command = re.sub(r"\s+#.*$", "", raw).strip()
        lines += [part.strip() for part in command.split(";") if part.strip()]
    return lines


def test_the_readme_tour_runs_in_order(tmp_path):
    home = tmp_path / "tour"
    home.mkdir()
    (home / "presets").symlink_to(REPO / "presets")
    write_txt(home / "my_texts", corpus_texts()[:40])
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "120", "PYTHONPATH": str(REPO)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # the venv's `forge`

    def forge(line: str) -> subprocess.CompletedProcess:
        args = shlex.split(line)
        assert args[0] == "forge", line
        return subprocess.run(
            [sys.executable, "-m", "forgecli.app", *args[1:]],
            cwd=home,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    made = forge("forge train presets/debug.toml --train.max_steps=4")  # `make train`, cut short
    assert made.returncode == 0, made.stderr[-3000:]
    ran, used = [], set()
    for written in tour_lines():
        key = next((key for key in SKIPPED if key in written), None)
        if key is not None:
            used.add(key)
            continue
        line = written
        for before, after in SHORTER:
            line = line.replace(before, after)
        began = time.monotonic()
        result = forge(line)
        print(f"{time.monotonic() - began:5.1f}s  {line}")
        output = result.stdout + result.stderr
        expected = next((2 for key in EXIT_2 if key in line), 0)
        assert result.returncode == expected, f"$ {line}\n{output[-4000:]}"
        assert "Traceback" not in output, f"$ {line}\n{output[-4000:]}"
        for key, said in EXIT_2.items():
            if key in line:
                assert said in " ".join(output.replace("│", " ").split()), output
        ran.append(line)
    assert len(ran) >= 20 and used == set(SKIPPED), (ran, used)  # every skip still names a tour line
    assert (home / "lr.png").is_file() and (home / "studies" / "125m" / "plan.json").is_file()
