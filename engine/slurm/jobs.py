"""Submitting, following and stopping `forge slurm` jobs through SLURM's client tools.

A submission leaves in each run directory a `slurm/` folder: the rendered script (`job.sbatch`), one JSON line
per submission (`jobs.jsonl`: job id, script, submit time, arguments), the job's output across all attempts
(`output.log`, appended to), and one line per attempt event written by the script itself (`events.log`:
start, requeue, end, gave-up, stopped). Status is read from SLURM while it knows the job (scontrol, then sacct)
and from those files after, so a finished job can still be described on a cluster without accounting.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import UserError
from engine.run_files import METRICS_FILE, RUN_CONFIG
from engine.slurm.render import (
    SCRIPT_NAME,
    SlurmRequest,
    SweepPoint,
    check_signal_lead,
    render,
    sweep_points,
    template_context,
)

if TYPE_CHECKING:
    from engine.config import JobConfig

SLURM_DIR = "slurm"
RECORDS = "jobs.jsonl"
OUTPUT = "output.log"
EVENTS = "events.log"
STOP_MARKER = "stop"
ACTIVE_STATES = {
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "CONFIGURING",
    "COMPLETING",
    "RESIZING",
    "SUSPENDED",
    "STOPPED",
    "SIGNALING",
    "STAGE_OUT",
}
TOOL_TIMEOUT = 60


def require_tool(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise UserError(
            f"{tool} not found on PATH: `forge slurm` needs SLURM's client tools",
            "run it on a login node of the cluster (or `module load slurm`); "
            "`forge slurm submit --dry-run` prints the script without them",
        )
    return path


SBATCH_REFUSED = (
    "nothing was submitted and the folders made for the job were removed: fix what sbatch says (a partition, "
    "account, QOS or limit of this cluster: --partition, --account, --qos, --time, --sbatch-arg) and submit "
    "again; --dry-run prints the script"
)


def slurm(tool: str, *args: str, check: bool = True, hint: str = "") -> subprocess.CompletedProcess:
    """Run a SLURM client tool (argument list, no shell); a failure is a user error that quotes its message."""
    done = subprocess.run([require_tool(tool), *args], capture_output=True, text=True, timeout=TOOL_TIMEOUT)
    if check and done.returncode != 0:
        raise UserError(f"{tool} {' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}", hint)
    return done


@contextmanager
def removed_on_failure(folders: list[Path]) -> Iterator[None]:
    """The folders a submission is about to make (and the missing parents it makes with them), removed again
    if the block fails, so that a refused sbatch leaves no empty run or sweep folders behind; a folder that
    was there before is kept."""
    made = list(dict.fromkeys(outermost_missing(folder) for folder in folders if not folder.exists()))
    try:
        yield
    except BaseException:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
        raise


def outermost_missing(folder: Path) -> Path:
    while not folder.parent.exists():
        folder = folder.parent
    return folder


@dataclass
class Submission:
    """A rendered, checked submission: the script and the run directories it will write."""

    request: SlurmRequest
    script: str
    points: list[SweepPoint]
    argv: list[str] = field(default_factory=list)

    @property
    def script_path(self) -> Path:
        return self.request.run_dir / SLURM_DIR / SCRIPT_NAME

    @property
    def run_dirs(self) -> list[Path]:
        return [p.run_dir for p in self.points] or [self.request.run_dir]


def prepare(req: SlurmRequest, template: Path, argv: list[str], points: list[SweepPoint] | None = None) -> Submission:
    """Check every point's config for the job's world size exactly as `forge validate-config --world-size`
    does (cross-section rules and the memory estimate), check the signal lead, and render the script.
    `points`: the array's tasks when the caller has them already (`forge scale run --slurm`); by default
    those of `req.sweep`, or none (one job)."""
    from engine.config import load_job_config
    from engine.plan import resolve

    if points is None:
        points = sweep_points(req.sweep, req.run_dir) if req.sweep else []
    shutdown = 0.0
    for preset, overrides, run_dir in (
        ((p.preset or req.preset, req.overrides + p.overrides, p.run_dir) for p in points)
        if points
        else [(req.preset, req.overrides, req.run_dir)]
    ):
        job = resolve(load_job_config(preset, overrides), req.world_size)
        cfg, stages = job.given, job.memory
        check_signal_lead(req.signal_lead, cfg.train.shutdown_timeout_sec, max(s.params + s.optimizer for s in stages))
        check_existing_run(cfg, run_dir)
        shutdown = max(shutdown, cfg.train.shutdown_timeout_sec)
    script = render(template, template_context(req, points, Path.cwd(), shutdown))
    return Submission(req, script, points, argv)


def check_existing_run(cfg: JobConfig, run_dir: Path) -> None:
    """A run directory that already holds a run must be one `cfg` may continue (what `forge train` will check
    when the job starts, said now rather than in the job's log)."""
    from engine.config import load_job_config
    from engine.config.changes import resume_issues
    from engine.errors import ConfigError

    saved = run_dir / RUN_CONFIG
    if saved.is_file() and (issues := resume_issues(load_job_config(saved), cfg)):
        raise ConfigError(issues, f"{run_dir} (an existing run: it resumes with its own config)")


def submit(sub: Submission) -> str:
    """Write the script, submit it (`sbatch --parsable`), keep a record in every run directory; the job id."""
    require_tool("sbatch")
    folders = [run_dir / SLURM_DIR for run_dir in [sub.request.run_dir, *sub.run_dirs]]
    with removed_on_failure(folders):
        for folder in folders:
            folder.mkdir(parents=True, exist_ok=True)
        sub.script_path.write_text(sub.script)
        job_id = slurm("sbatch", "--parsable", str(sub.script_path), hint=SBATCH_REFUSED).stdout
    job_id = job_id.strip().split(";")[0]
    for folder in folders:
        (folder / STOP_MARKER).unlink(missing_ok=True)  # a new submission runs until told otherwise
    record = {"job_id": job_id, "script": str(sub.script_path), "submitted_at": now(), "argv": sub.argv}
    if sub.points:
        record["points"] = [str(p.run_dir) for p in sub.points]
        for index, point in enumerate(sub.points):
            append_record(
                point.run_dir,
                {**record, "job_id": f"{job_id}_{index}", "array_job": job_id, "overrides": point.overrides},
            )
    append_record(sub.request.run_dir, record)
    return job_id


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def append_record(run_dir: Path, record: dict) -> None:
    with open(run_dir / SLURM_DIR / RECORDS, "a") as out:
        out.write(json.dumps(record) + "\n")


def latest_record(run_dir: Path) -> dict:
    path = run_dir / SLURM_DIR / RECORDS
    if not path.is_file():
        raise UserError(
            f"{run_dir} holds no `forge slurm` job ({path} is missing)",
            "pass the --run-dir given to `forge slurm submit`, or a job id",
        )
    return json.loads(path.read_text().splitlines()[-1])


def run_dir_of(target: str) -> Path:
    """A run directory given as itself, or as the id of a job `forge slurm submit` made (read from the
    job's script path, which lies in the run directory; an array task maps to its sweep point)."""
    if Path(target).is_dir():
        return Path(target)
    if not re.fullmatch(r"\d+(_\d+)?", target):
        raise UserError(f"{target} is neither a run directory nor a job id", "pass RUN_DIR or JOBID")
    info = scontrol_job(target)
    if not info or "Command" not in info:
        raise UserError(f"SLURM does not know job {target} (any more)", "pass its run directory instead")
    base = Path(info["Command"]).parent.parent
    record = latest_record(base)
    if "points" in record and "_" in target:
        return Path(record["points"][int(target.split("_")[1])])
    return base


def scontrol_job(job_id: str) -> dict[str, str]:
    """`scontrol show job -o` as a dict; empty when SLURM no longer knows the job."""
    done = slurm("scontrol", "show", "job", "-o", job_id, check=False)
    if done.returncode != 0 or not done.stdout.strip():
        return {}
    first = done.stdout.strip().splitlines()[0]
    return dict(re.findall(r"(\w+(?:/\w+)?)=(.*?)(?= \w+(?:/\w+)?=|$)", first))


def sacct_job(job_id: str) -> dict[str, str]:
    """The job's accounting line, for a job slurmctld has forgotten; empty without accounting storage."""
    if shutil.which("sacct") is None:
        return {}
    done = slurm("sacct", "-n", "-P", "-X", "-j", job_id, "--format=State,Elapsed,NodeList,ExitCode", check=False)
    lines = done.stdout.strip().splitlines() if done.returncode == 0 else []
    if not lines:
        return {}
    state, elapsed, nodes, exit_code = lines[-1].split("|")
    return {"JobState": state.split()[0], "RunTime": elapsed, "NodeList": nodes, "ExitCode": exit_code}


@dataclass
class Attempt:
    job: str
    attempt: int
    start: str
    nodes: str
    end: str | None = None
    outcome: str | None = None
    exit_code: int | None = None


def attempts(run_dir: Path) -> list[Attempt]:
    """The job's attempts, from the events the batch script wrote."""
    path = run_dir / SLURM_DIR / EVENTS
    out: list[Attempt] = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        stamp, job, attempt, kind, *rest = line.split()
        fields = dict(item.split("=", 1) for item in rest if "=" in item)
        if kind == "start":
            out.append(Attempt(job.split("=")[1], int(attempt.split("=")[1]), stamp, fields.get("nodes", "")))
        elif out:
            out[-1].end, out[-1].outcome = stamp, kind
            out[-1].exit_code = int(fields["exit"]) if "exit" in fields else None
    return out


def last_step(run_dir: Path) -> dict | None:
    """The last training step the run logged (step, loss), from its metrics."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return None
    for line in reversed(path.read_text().splitlines()):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line being written
        if "loss" in record:
            return {"step": record["step"], "loss": record["loss"]}
    return None


def job_status(run_dir: Path) -> dict:
    """State, elapsed time, restarts, nodes and the last logged step of the run's newest job."""
    record = latest_record(run_dir)
    job_id = record["job_id"]
    info = scontrol_job(job_id) or sacct_job(job_id)
    tries = attempts(run_dir)
    restarts = int(info["Restarts"]) if "Restarts" in info else sum(a.outcome == "requeue" for a in tries)
    state = info.get("JobState") or (describe_end(tries[-1]) if tries else "UNKNOWN")
    return {
        "job_id": job_id,
        "run_dir": str(run_dir),
        "state": state,
        "reason": info.get("Reason"),
        "elapsed": info.get("RunTime"),
        "restarts": restarts,
        "nodes": info.get("NodeList") or (tries[-1].nodes if tries else None),
        "exit_code": info.get("ExitCode"),
        "submitted_at": record["submitted_at"],
        "last": last_step(run_dir),
        "attempts": [asdict(a) for a in tries],
        "outcome": describe_end(tries[-1]) if tries and state not in ACTIVE_STATES else None,
        "source": "scontrol" if "Restarts" in info else ("sacct" if info else "run directory"),
    }


def describe_end(attempt: Attempt) -> str:
    """A state for a job SLURM has forgotten, from how its last attempt ended."""
    if attempt.outcome is None:
        return "UNKNOWN (the last attempt logged no end)"
    if attempt.outcome == "end":
        return "COMPLETED" if attempt.exit_code == 0 else f"FAILED (exit {attempt.exit_code})"
    return {
        "gave-up": "STOPPED: preempted more than --max-requeues times; the newest checkpoint is kept, "
        "submit again with the same --run-dir to continue",
        "stopped": "STOPPED (forge slurm cancel --graceful)",
        "requeue": "REQUEUED",
    }[attempt.outcome]


def is_active(job_id: str) -> bool:
    info = scontrol_job(job_id)
    return bool(info) and info.get("JobState") in ACTIVE_STATES


def follow(run_dir: Path, poll: float = 1.0) -> Iterator[str]:
    """The job's output so far, then new lines as they come (across requeues, which append to the same file),
    until the job is over and everything is read."""
    path = run_dir / SLURM_DIR / OUTPUT
    job_id = latest_record(run_dir)["job_id"]
    position = 0
    while True:
        active = is_active(job_id)
        if path.is_file():
            with open(path, errors="replace") as log:
                log.seek(position)
                chunk = log.read()
                position = log.tell()
            yield from chunk.splitlines(keepends=True)
        if not active:
            return
        time.sleep(poll)


def read_log(run_dir: Path) -> str:
    path = run_dir / SLURM_DIR / OUTPUT
    if not path.is_file():
        latest_record(run_dir)  # says so if this is no job's run directory
        return ""
    return path.read_text(errors="replace")


def cancel(run_dir: Path, graceful: bool, wait_seconds: float) -> str:
    """Cancel the run's job. Graceful: mark the run stopped (so the script does not requeue it), send the ranks
    the preemption signal so they checkpoint and exit, wait up to `wait_seconds` for the job to end, and cancel
    it only if it has not. Returns what was done."""
    job_id = latest_record(run_dir)["job_id"]
    if not graceful:
        slurm("scancel", job_id)
        return f"cancelled job {job_id}"
    (run_dir / SLURM_DIR / STOP_MARKER).touch()
    if scontrol_job(job_id).get("JobState") != "RUNNING":
        slurm("scancel", job_id)
        return f"job {job_id} was not running: cancelled"
    slurm("scancel", "--signal=USR1", job_id)
    deadline = time.monotonic() + wait_seconds
    while is_active(job_id) and time.monotonic() < deadline:
        time.sleep(1)
    if is_active(job_id):
        slurm("scancel", job_id)
        return f"job {job_id} did not stop within {wait_seconds:g} s of the signal: cancelled"
    return f"job {job_id} saved a checkpoint and stopped"
