"""The sbatch script of a submission: what is asked for (`SlurmRequest`), the checks made before anything is
submitted (the config for the world size, the signal lead against the shutdown timeout and the save time),
sweep points, and rendering with Jinja2 where every value is shell-quoted."""

from __future__ import annotations

import itertools
import math
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import UserError

DEFAULT_TEMPLATE = Path(__file__).resolve().parents[2] / "templates" / "slurm.sbatch"
# Assumed write speed of one rank's checkpoint shard, for the save-time estimate: a conservative figure for a
# parallel file system shared by many ranks (a local NVMe is ten times faster, a busy NFS slower).
SAVE_BYTES_PER_SEC = 500e6
SLURM_MAX_SIGNAL_LEAD = 65535  # sbatch --signal takes at most this many seconds
SCRIPT_NAME = "job.sbatch"


@dataclass
class SlurmRequest:
    """Everything `forge slurm submit` was asked for; paths are absolute by the time it is rendered."""

    preset: Path
    overrides: list[str]
    run_dir: Path
    nodes: int = 1
    gpus_per_node: int = 0
    ntasks_per_node: int | None = None
    cpus_per_task: int = 1
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    job_name: str | None = None
    signal_lead: int = 600
    max_requeues: int = 3
    sbatch_args: list[str] = field(default_factory=list)
    sweep: list[str] = field(default_factory=list)
    after: str | None = None
    after_ok: str | None = None
    allow_code: bool = False  # the job's `forge train` gets --allow-code (the user passed it to submit)

    @property
    def tasks_per_node(self) -> int:
        """One task per GPU unless asked otherwise; CPU jobs say how many."""
        return self.ntasks_per_node or self.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


@dataclass(frozen=True)
class SweepPoint:
    """One array task: its run directory and overrides, and its own preset where the points differ in more
    than overrides (`forge scale run --slurm`: one resolved config per point; None = the request's preset)."""

    overrides: list[str]
    run_dir: Path
    preset: Path | None = None


def sweep_points(sweep: list[str], base: Path) -> list[SweepPoint]:
    """The cartesian product of `section.key=v1,v2,…` axes, one run directory under `base` per point, named
    from the values (`lr=1e-3_seed=1`)."""
    axes = []
    for axis in sweep:
        key, sep, values = axis.removeprefix("--").partition("=")
        if not sep or key.count(".") != 1 or not values:
            raise UserError(
                f"--sweep {axis!r} is not section.key=value1,value2,…", "e.g. --sweep optimizer.lr=1e-3,3e-4"
            )
        axes.append([(key, value.strip()) for value in values.split(",")])
    points = []
    for combo in itertools.product(*axes):
        name = "_".join(f"{key.split('.')[1]}={value}" for key, value in combo)
        name = re.sub(r"[^A-Za-z0-9._=+-]", "-", name)
        points.append(SweepPoint([f"--{key}={value}" for key, value in combo], base / name))
    if len({p.run_dir for p in points}) != len(points):
        raise UserError("two sweep points get the same run directory name", "make the swept values distinct")
    return points


def save_seconds(checkpoint_bytes: int) -> float:
    """Estimated time for one rank to write its checkpoint shard at SAVE_BYTES_PER_SEC."""
    return checkpoint_bytes / SAVE_BYTES_PER_SEC


def check_signal_lead(lead: int, shutdown_timeout: float, checkpoint_bytes: int) -> None:
    """The signal must come early enough for the ranks to finish their step, save and exit before SLURM kills
    the job: refuse a lead shorter than train.shutdown_timeout_sec (the longest the ranks take before their
    watchdog ends them) plus the estimated save time, and a shutdown timeout the save itself cannot fit in."""
    save = save_seconds(checkpoint_bytes)
    facts = (
        f"train.shutdown_timeout_sec = {shutdown_timeout:g} s, estimated checkpoint save {save:.1f} s "
        f"({checkpoint_bytes / 2**30:.2f} GiB per rank at an assumed {SAVE_BYTES_PER_SEC / 1e6:.0f} MB/s)"
    )
    if shutdown_timeout < save:
        raise UserError(
            f"the emergency checkpoint cannot be saved within the shutdown timeout: {facts}",
            f"raise train.shutdown_timeout_sec to at least {math.ceil(save)}",
        )
    needed = math.ceil(shutdown_timeout + save)
    if lead < needed:
        raise UserError(
            f"--signal-lead {lead} s is too short: {facts}, so the ranks need up to {needed} s",
            f"pass --signal-lead {needed} or more, or lower train.shutdown_timeout_sec",
        )
    if lead > SLURM_MAX_SIGNAL_LEAD:
        raise UserError(f"--signal-lead {lead} s is more than SLURM accepts ({SLURM_MAX_SIGNAL_LEAD} s)", "")


def check_directive(name: str, value: str | None) -> None:
    """Values of #SBATCH lines are quoted, but a line break would still end the directive."""
    if value is not None and ("\n" in value or "\r" in value):
        raise UserError(f"{name} contains a line break", "remove it")


def template_context(
    req: SlurmRequest, points: list[SweepPoint], workdir: Path, shutdown_timeout: float
) -> dict[str, object]:
    """The values the template sees (each is shell-quoted when rendered). srun waits for the other ranks the
    shutdown timeout plus a minute after the first one ends (they may still be saving)."""
    for name in ("--time", "--partition", "--account", "--qos", "--job-name", "--run-dir", "--after", "--after-ok"):
        check_directive(
            name, getattr(req, name[2:].replace("-", "_"), None) if name != "--run-dir" else str(req.run_dir)
        )
    for arg in req.sbatch_args:
        check_directive("--sbatch-arg", arg)
    if "%" in str(req.run_dir):
        raise UserError(f"--run-dir {req.run_dir} contains '%', which SLURM reads as a file name pattern", "rename it")
    dependency = ",".join(f"{kind}:{job}" for kind, job in (("afterany", req.after), ("afterok", req.after_ok)) if job)
    output = req.run_dir / ("slurm-%A_%a.out" if points else "slurm/output.log")
    return {
        "job_name": req.job_name or req.run_dir.name,
        "nodes": req.nodes,
        "ntasks_per_node": req.tasks_per_node,
        "cpus_per_task": req.cpus_per_task,
        "gpus_per_node": req.gpus_per_node,
        "time": req.time,
        "partition": req.partition,
        "account": req.account,
        "qos": req.qos,
        "signal_lead": req.signal_lead,
        "workdir": workdir,
        "output": output,
        "array": f"0-{len(points) - 1}" if points else None,
        "dependency": dependency,
        "sbatch_args": req.sbatch_args,
        "preset": req.preset,
        "max_requeues": req.max_requeues,
        "overrides": req.overrides,
        "points": points,
        "run_dir": req.run_dir,
        "python": sys.executable,
        "srun_wait": math.ceil(shutdown_timeout) + 60,
        "allow_code": req.allow_code,
    }


def render(template: Path, context: dict[str, object]) -> str:
    """Render with every `{{ value }}` shell-quoted (the template never sees an unquoted value), and none that
    would break a `#SBATCH` line (`checked_directives`)."""
    import jinja2

    if not template.is_file():
        raise UserError(
            f"sbatch template {template} not found",
            "pass --template FILE (a copy of templates/slurm.sbatch from the Forge repository)",
        )
    env = jinja2.Environment(
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
        finalize=marked_value,
    )
    try:
        script = env.from_string(template.read_text()).render(context)
    except jinja2.TemplateError as err:
        raise UserError(f"sbatch template {template}: {err}", "fix the template") from None
    return checked_directives(script)


# While a script is rendered, each value is wrapped in these two private-use characters, so that the check after
# rendering knows which text came from a value and on which line it stands; they are removed before it is used.
VALUE_START, VALUE_END = "\ue000", "\ue001"
CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")
# What the user changes when a directive's value is refused; the rest come from the option of the same name.
DIRECTIVE_SOURCES = {
    "--chdir": "the working directory (the job starts where forge slurm is run)",
    "--output": "the --run-dir (or --out) the job's log is written under",
}


def marked_value(value: object) -> str:
    text = str(value)
    if VALUE_START in text or VALUE_END in text:
        raise UserError(f"{text!r} holds the character U+E000 or U+E001, which Forge cannot render", "remove it")
    return VALUE_START + shlex.quote(text) + VALUE_END


def checked_directives(script: str) -> str:
    """Refuse a control character (a line break above all) in any value of a `#SBATCH` line: sbatch reads a
    directive to the end of its line, and no quoting carries a line break through it, so what follows it would
    run as commands of the job. Elsewhere a shell-quoted value may hold any character. → the script, unmarked."""
    for value in re.finditer(f"{VALUE_START}(.*?){VALUE_END}", script, re.DOTALL):
        line = script[script.rfind("\n", 0, value.start()) + 1 : value.start()]
        if line.lstrip().startswith("#SBATCH") and CONTROL_CHARACTER.search(value.group(1)):
            directive = line.split("=")[0].removeprefix("#SBATCH").strip() or "--sbatch-arg"
            source = DIRECTIVE_SOURCES.get(directive, directive)
            raise UserError(
                f"#SBATCH {directive} would get {shlex.split(value.group(1))[0]!r} from {source}, which holds a line break or "
                "another control character: sbatch ends a directive at the end of its line and would run the rest "
                "as commands",
                "run forge slurm from a folder whose path has no line break or control character"
                if directive == "--chdir"
                else f"remove the control character from {source}",
            )
    return script.replace(VALUE_START, "").replace(VALUE_END, "")
