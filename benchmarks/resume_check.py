"""Exact resume end to end on whatever device `forge train` picks (the GPU check of benchmarks/results/gpu_h100.md):
an uninterrupted 1000-step run of presets/debug.toml, then the same run stopped at step 300 by SIGKILL and,
separately, by SIGTERM (emergency checkpoint, exit 75), each resumed with `forge train`; prints whether every
step's loss and grad norm equal the uninterrupted run's. Uses /tmp/r.

    python benchmarks/resume_check.py
"""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ARGS = [
    "presets/debug.toml",
    "--train.max_steps=1000",
    "--checkpoint.interval=200",
    "--metrics.log_interval=1",
    "--eval.interval=300",
]


def forge(run_dir, *extra, wait=True):
    cmd = [sys.executable, "-m", "forgecli.app", "train", *ARGS, "--run-dir", str(run_dir), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc.wait() if wait else proc


def losses(run_dir):
    recs = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except ValueError:  # a line still being written
            pass
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in recs if "loss" in r}


def interrupt(run_dir, sig, at):
    proc = forge(run_dir, wait=False)
    while proc.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and any(k >= at for k in losses(run_dir)):
            break
        time.sleep(0.002)
    proc.send_signal(sig)
    return proc.wait()


def main() -> None:
    shutil.rmtree("/tmp/r", ignore_errors=True)
    start = time.time()
    whole = Path("/tmp/r/whole")
    forge(whole)
    print("uninterrupted run", round(time.time() - start, 1), "s", flush=True)
    report = {}
    for name, sig in (("sigkill", signal.SIGKILL), ("sigterm", signal.SIGTERM)):
        run = Path(f"/tmp/r/{name}")
        exit_code = interrupt(run, sig, 300)
        stopped = max(losses(run))
        resumed = forge(run)
        ours, theirs = losses(run), losses(whole)
        report[name] = {
            "exit_code": exit_code,
            "stopped_after_step": stopped,
            "resume_exit": resumed,
            "steps_equal": sum(ours[s] == theirs[s] for s in theirs),
            "steps": len(theirs),
            "bitwise_equal": ours == theirs,
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
