"""The one-GPU suite: what `benchmarks/gpu_suite.sh` runs, in order, inside a time budget, and records.

Items (each its own process, so each has the GPU to itself and its own peak memory):

- `forge train presets/1b.toml` (Llama 3.2 1B, batch 4 × 4096, per-block compile) in bf16, FP8 tensorwise and
  FP8 rowwise, each with the plain and the chunked cross-entropy: tokens/s and MFU of the last logged window
  (after compilation), the measured peak memory, and `engine.parallel.memory.estimate_memory` of the run's own
  resolved config beside it (estimate / measured);
- the same 1B run in bf16 with `--optimizer.name=muon`: Muon's optimizer step, against the bf16 AdamW row;
- `benchmarks/gpu_race.py`: Forge against torchtitan on the 1B shape, eager and compiled;
- `forge train presets/moe_small.toml --distributed.ep=1`: the MoE preset on one device.

Every training run takes one micro-batch a step (`train.grad_accum_steps = 1`), no evaluation, and writes its
run directory (and its one final checkpoint, 13.8 GiB at 1B) under `--work`, deleted after the item.

Budget: the items run in the order above until `--budget-sec` is spent; an item gets the time left, and one
that does not finish or fails is recorded with its reason and the tail of its output, never with a number.
Output: `<out>.json` (machine, versions, commit, every item's command and measured values) and `<out>.md`
(the same as tables).

`--toy` (CPU, the suite's test: tests/benchmarks/test_gpu_suite.py): the same items at toy size (the race's TOY shape,
sequence 32, batch 2, a few steps), without FP8 (CPU has none: those rows say "not run: toy mode") and without
compile, each command run inside this process (`--in-process`, the toy's default): starting an interpreter
per item would cost the toy run more than its work. The commands and the reading of their results are the same.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_race import TOY  # noqa: E402  (the toy shape the race's own CPU check uses)

FORGE = [sys.executable, "-c", "import sys; sys.argv[0] = 'forge'; from forgecli.app import main; main()"]
GIB = 2**30
PRECISIONS = {"bf16": [], "fp8 tensorwise": ["fp8", "tensorwise"], "fp8 rowwise": ["fp8", "rowwise"]}
LOSSES = ("cross_entropy", "chunked_cross_entropy")


@dataclass
class Item:
    """One thing the suite runs: its name, the command, and how its measured values are read afterwards."""

    name: str
    kind: str  # "train", "race"
    program: str  # "forge" or "race": which entry point `argv` is for
    argv: list[str]
    run_dir: Path | None = None
    skip: str | None = None  # why it is not run at all (toy mode's FP8)
    result: dict = field(default_factory=dict)

    @property
    def command(self) -> list[str]:
        return [*PROGRAMS[self.program], *self.argv]


PROGRAMS = {"forge": FORGE, "race": [sys.executable, "benchmarks/gpu_race.py"]}


def train_items(args: argparse.Namespace, work: Path) -> list[Item]:
    items = []
    # the toy vocabulary is the embedded corpus's tokenizer's (4096), which the race's random tokens need not be
    size = [*TOY, "--model.vocab_size=4096", "--train.seq_len=32", "--train.batch_size=2"] if args.toy else []
    steps = (
        ["--train.max_steps=4", "--metrics.log_interval=2"]
        if args.toy
        else ["--train.max_steps=20", "--metrics.log_interval=10"]
    )
    common = ["--train.grad_accum_steps=1", "--eval.enabled=false", *steps]
    if args.toy:
        common.append("--train.compile_model=false")
    for precision, recipe in PRECISIONS.items():
        for loss in LOSSES:
            name = f"1b {precision} {loss}"
            run_dir = work / name.replace(" ", "_")
            precise = [f"--train.mixed_precision={recipe[0]}", f"--train.fp8_recipe={recipe[1]}"] if recipe else []
            argv = ["train", "presets/1b.toml", *size, *common, f"--train.loss_fn={loss}", *precise]
            items.append(Item(name, "train", "forge", [*argv, "--run-dir", str(run_dir)], run_dir))
            if recipe and args.toy:
                items[-1].skip = "not run: toy mode (no FP8 on CPU)"
    # Muon's optimizer step at 1B (each hidden matrix orthogonalized by Newton–Schulz in bf16): its tokens/s
    # against the "1b bf16 cross_entropy" row above, which differs from it only in the optimizer
    run_dir = work / "1b_bf16_muon"
    argv = ["train", "presets/1b.toml", *size, *common, "--optimizer.name=muon", "--run-dir", str(run_dir)]
    items.append(Item("1b bf16 muon", "train", "forge", argv, run_dir))
    moe_size = (
        [
            "--model.dim=64",
            "--model.n_layers=2",
            "--model.n_heads=4",
            "--model.vocab_size=4096",
            "--model.num_experts=4",
            "--model.moe_top_k=2",
            "--model.max_seq_len=64",
            "--train.seq_len=32",
            "--train.batch_size=2",
        ]
        if args.toy
        else ["--train.batch_size=4", "--train.compile_model=true"]
    )
    run_dir = work / "moe_small_ep1"
    argv = ["train", "presets/moe_small.toml", *moe_size, *common, "--distributed.ep=1", "--run-dir", str(run_dir)]
    items.append(Item("moe_small ep=1", "train", "forge", argv, run_dir))
    return items


def race_item(args: argparse.Namespace, work: Path) -> Item:
    out = work / "race.json"
    if args.toy:
        sizes = ["--device", "cpu", "--toy", "--modes", "bf16", "--steps", "1", "--warmup", "1"]
        sizes += ["--seq-len", "32", "--batch-size", "2"]
    else:
        sizes = ["--modes", "bf16,bf16+compile", "--steps", "10", "--warmup", "3"]
    return Item("race vs torchtitan", "race", "race", [*sizes, "--out", str(out)], out)


def run(item: Item, seconds_left: float, log: Path, in_process: bool) -> None:
    """Run `item` within `seconds_left` (in its own process, or in this one), then read what it measured into
    `item.result`."""
    if item.skip:
        item.result = {"status": item.skip}
        return
    if seconds_left < 10:
        item.result = {"status": "not run: the suite's time budget was spent"}
        return
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with log.open("a") as sink:
        sink.write(f"\n$ {' '.join(item.command)}\n")
        sink.flush()
        if in_process:
            code = run_here(item)
        else:
            try:
                done = subprocess.run(
                    item.command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=seconds_left
                )
                code = done.returncode
            except subprocess.TimeoutExpired:
                code = None
    seconds = time.perf_counter() - start
    if code != 0:
        reason = "timed out (budget)" if code is None else f"failed (exit {code})"
        item.result = {"status": f"not measured: {reason}", "seconds": seconds, "log_tail": tail(log)}
        return
    read = train_result if item.kind == "train" else race_result
    try:
        item.result = {"status": "measured", "seconds": seconds, "command": item.command, **read(item.run_dir)}
    except (OSError, KeyError, ValueError, RuntimeError) as err:  # ran, but left no readable measurement
        item.result = {"status": f"not measured: {err}", "seconds": seconds, "log_tail": tail(log)}


def run_here(item: Item) -> int:
    """The item's command in this process (the toy run): → its exit code. Its output goes to this process's
    (the CLI keeps the console it first printed to, so it is not redirected into the log)."""
    try:
        if item.program == "forge":
            from forgecli.app import app

            app(item.argv, prog_name="forge")
        else:
            from benchmarks.gpu_race import main as race

            race(item.argv)
    except SystemExit as ended:
        return ended.code if isinstance(ended.code, int) else (0 if ended.code is None else 1)
    return 0


def train_result(run_dir: Path) -> dict:
    """The last logged window's throughput and the run's peak memory, and the estimate of its resolved config."""
    from engine.config.loader import load_job_config
    from engine.model.estimate import training_flops_per_token
    from engine.parallel.memory import estimate_memory

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    logged = [r for r in records if "tokens_per_sec" in r]
    if len(logged) < 2:
        raise RuntimeError(f"{run_dir}: fewer than two logged steps in metrics.jsonl")
    last = logged[-1]
    cfg = load_job_config(run_dir / "config.toml")
    estimate = estimate_memory(cfg, 1)[0].total / GIB
    peak = max(r["mem_peak_gib"] for r in logged)
    return {
        "step": last["step"],
        "window_steps": last["step"] - logged[-2]["step"],
        "tokens_per_step": cfg.train.batch_size * cfg.train.seq_len * cfg.train.grad_accum_steps,
        "flops_per_token": training_flops_per_token(cfg.model, cfg.train.seq_len),
        "tokens_per_sec": last["tokens_per_sec"],
        "mfu": last["mfu"],
        "loss": last["loss"],
        "mem_peak_gib": peak,
        "mem_estimate_gib": estimate,
        "estimate_over_peak": estimate / peak if peak else None,
    }


def race_result(out: Path) -> dict:
    report = json.loads(out.read_text())
    rows = {}
    for mode, runs in report["results"].items():
        rows[mode] = {
            "forge_tokens_per_sec": runs["forge"]["tokens_per_sec"],
            "torchtitan_tokens_per_sec": runs["torchtitan"]["tokens_per_sec"],
            "forge_over_torchtitan": runs["forge_over_torchtitan_tokens_per_sec"],
            "forge_mfu": runs["forge"]["mfu"],
            "torchtitan_mfu": runs["torchtitan"]["mfu"],
        }
    return {"modes": rows, "torchtitan": report["setup"]["torchtitan"]}


def tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def machine() -> dict:
    """Hardware, versions and commit, as the record needs them."""
    import torch

    def version(name: str) -> str:
        """From the package's metadata, without importing it (torchtitan needs gpu_race's shim on torch 2.11)."""
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True)
    gpu = nvidia_smi()
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "device": gpu.get("name") or platform.processor() or "cpu",
        "gpu_memory": gpu.get("memory.total"),
        "gpu_driver": gpu.get("driver_version"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torchao": version("torchao"),
        "torchtitan": version("torchtitan"),
        "commit": commit.stdout.strip() or "unknown (no git)",
        "uncommitted_changes": bool(dirty.stdout.strip()),
    }


def nvidia_smi() -> dict[str, str]:
    """The first GPU's name, memory and driver from nvidia-smi, without starting CUDA in this process (its
    context would take GPU memory from the runs); empty where there is none."""
    fields = ("name", "memory.total", "driver_version")
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    lines = out.stdout.strip().splitlines()
    return dict(zip(fields, (v.strip() for v in lines[0].split(",")))) if out.returncode == 0 and lines else {}


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"# GPU suite{' (toy size, CPU)' if report['toy'] else ''}: {m['device']}",
        "",
        f"- Recorded {m['date_utc']} UTC by `{report['command']}` in {report['seconds']:.0f} s.",
        f"- Python {m['python']}, torch {m['torch']} (CUDA {m['cuda']}), torchao {m['torchao']}, "
        f"torchtitan {m['torchtitan']}; {m['cpus']} CPUs"
        + (f"; GPU memory {m['gpu_memory']}, driver {m['gpu_driver']}." if m["gpu_memory"] else "."),
        f"- Commit {m['commit']}{' with uncommitted changes' if m['uncommitted_changes'] else ''}.",
        "",
        "## forge train",
        "",
        "| run | status | tokens/s | MFU | peak memory | estimate | estimate / peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in report["train"].items():
        if r["status"] != "measured":
            lines.append(f"| {name} | {r['status']} | not measured | not measured | not measured | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "no peak known"
        lines.append(
            f"| {name} | measured (step {r['step']}) | {r['tokens_per_sec']:,.0f} | {mfu} | "
            f"{r['mem_peak_gib']:.2f} GiB | {r['mem_estimate_gib']:.2f} GiB | {r['estimate_over_peak']:.2f} |"
        )
    lines += ["", "## Race against torchtitan (benchmarks/gpu_race.py)", ""]
    race = report["race"]
    if race["status"] != "measured":
        lines.append(f"{race['status']}.")
    else:
        lines += ["| mode | Forge tokens/s | torchtitan tokens/s | Forge / torchtitan |", "|---|---|---|---|"]
        for mode, r in race["modes"].items():
            lines.append(
                f"| {mode} | {r['forge_tokens_per_sec']:,.0f} | {r['torchtitan_tokens_per_sec']:,.0f} | "
                f"{r['forge_over_torchtitan']:.2f}× |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--toy", action="store_true", help="toy sizes on CPU, no FP8, no compile (the suite's check)")
    p.add_argument("--budget-sec", type=float, default=480.0, help="stop starting items once this is spent")
    p.add_argument("--work", default="/dev/shm/forge-gpu-suite", help="run directories (deleted after each item)")
    p.add_argument("--out", default="benchmarks/results/gpu_suite", help="writes OUT.json and OUT.md")
    p.add_argument(
        "--in-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run each item inside this process (default: only with --toy)",
    )
    args = p.parse_args(argv)
    in_process = args.toy if args.in_process is None else args.in_process
    where = machine()  # before this run writes anything (the commit's "uncommitted changes" flag)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    log = Path(f"{args.out}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    start = time.perf_counter()
    items = train_items(args, work)
    items.insert(len(PRECISIONS) * len(LOSSES), race_item(args, work))  # the race before the MoE preset
    for item in items:
        print(f"[gpu_suite] {item.name}", flush=True)
        run(item, args.budget_sec - (time.perf_counter() - start), log, in_process)
        print(f"[gpu_suite] {item.name}: {item.result['status']}", flush=True)
        if item.run_dir is not None and item.run_dir.is_dir():
            shutil.rmtree(item.run_dir, ignore_errors=True)
    report = {
        "toy": args.toy,
        "in_process": in_process,
        "command": " ".join(["benchmarks/gpu_suite.sh", *(argv if argv is not None else sys.argv[1:])]),
        "seconds": time.perf_counter() - start,
        "machine": where,
        "train": {i.name: i.result for i in items if i.kind == "train"},
        "race": next(i.result for i in items if i.kind == "race"),
    }
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=2) + "\n")
    Path(f"{args.out}.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
