"""`forge slurm tokenize`: a corpus tokenized by an array job of N parts, then merged by a job that depends on it.

Part I is written to `PARTS/part-0000I` (PARTS defaults to `OUT.parts`, beside OUT), by `forge tokenize …
--num-shards N --shard-index I`; the merge job runs `forge tokenize merge` once every array task has
succeeded (`--dependency=afterok:ARRAY`, and `--kill-on-invalid-dep=yes` so a failed part cancels the merge
rather than leaving it pending forever). The scripts and the jobs' logs are kept in `PARTS/slurm/`.
Resubmitting after a failure resumes the parts (each `forge tokenize` resumes its own directory).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from engine.data import DEFAULT_SHARD_TOKENS
from engine.data.parts import Part
from engine.data.sources import FileSource
from engine.data.tokenize import check_request, kind_of
from engine.errors import DataError, UserError
from engine.slurm.jobs import SBATCH_REFUSED, SLURM_DIR, removed_on_failure, require_tool, slurm
from engine.slurm.render import check_directive, render

TEMPLATE = Path(__file__).resolve().parents[2] / "templates" / "slurm_tokenize.sbatch"
ARRAY_SCRIPT = "tokenize.sbatch"
MERGE_SCRIPT = "merge.sbatch"


@dataclass
class TokenizeJob:
    """What `forge slurm tokenize` was asked for; the `forge tokenize` options are passed to every part."""

    inputs: list[str]
    out: Path
    count: int
    tokenizer: Path
    eos_token: str | None = None
    text_field: str = "text"
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    hf_config: str | None = None
    split: str | None = None
    revision: str | None = None
    parts: Path | None = None
    cpus_per_task: int = 1
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    job_name: str | None = None
    sbatch_args: list[str] = field(default_factory=list)

    @property
    def parts_dir(self) -> Path:
        return self.parts or self.out.with_name(self.out.name + ".parts")

    def options(self) -> list[str]:
        given = {
            "--tokenizer": str(self.tokenizer),
            "--eos-token": self.eos_token,
            "--text-field": self.text_field,
            "--shard-tokens": str(self.shard_tokens),
            "--hf-config": self.hf_config,
            "--split": self.split,
            "--revision": self.revision,
        }
        return [item for name, value in given.items() if value is not None for item in (name, value)]

    def part_dirs(self) -> list[Path]:
        return [self.parts_dir / f"part-{index:05d}" for index in range(self.count)]


@dataclass(frozen=True)
class Scripts:
    array: str
    merge: str
    directory: Path

    def dry_run_text(self) -> str:
        merge_sbatch = f"sbatch --parsable --dependency=afterok:ARRAY_JOB_ID --kill-on-invalid-dep=yes {MERGE_SCRIPT}"
        return (
            f"# ---- {self.directory / ARRAY_SCRIPT}: submitted with sbatch --parsable {ARRAY_SCRIPT}\n"
            + self.array
            + f"\n# ---- {self.directory / MERGE_SCRIPT}: submitted with {merge_sbatch}\n"
            + self.merge
        )


def prepare(job: TokenizeJob, template: Path = TEMPLATE) -> Scripts:
    """Check what can be checked before submitting (the part count, the tokenizer, the output directories, the
    directives) and render both scripts."""
    Part(0, job.count)
    check_request(job.out, job.tokenizer, None, job.eos_token, job.shard_tokens)
    if not any(kind_of(text) for text in job.inputs):  # files, folders, URLs: checked as forge tokenize does
        FileSource(job.inputs).check(job.text_field)  # (a dataset is left to the parts: opening it downloads)
    if job.out.exists():
        raise DataError(f"--out {job.out} already exists", "choose a new directory for the merged data set")
    for name, value in (("--time", job.time), ("--partition", job.partition), ("--account", job.account),
                        ("--qos", job.qos), ("--job-name", job.job_name), ("--out", str(job.out)),
                        ("--parts", str(job.parts_dir))):  # fmt: skip
        check_directive(name, value)
    for arg in job.sbatch_args:
        check_directive("--sbatch-arg", arg)
    if "%" in str(job.parts_dir):
        raise UserError(f"{job.parts_dir} contains '%', which SLURM reads as a file name pattern", "rename it")
    logs = job.parts_dir / SLURM_DIR
    common = {
        "job_name": job.job_name or f"tokenize-{job.out.name}",
        "cpus_per_task": job.cpus_per_task,
        "time": job.time,
        "partition": job.partition,
        "account": job.account,
        "qos": job.qos,
        "workdir": Path.cwd(),
        "sbatch_args": job.sbatch_args,
        "python": sys.executable,
        "count": job.count,
        "inputs": job.inputs,
        "options": job.options(),
        "parts": job.parts_dir,
        "part_dirs": job.part_dirs(),
        "out": job.out,
    }
    array = render(template, {**common, "array": f"0-{job.count - 1}", "output": logs / "part-%a.log"})
    merge = render(template, {**common, "array": None, "output": logs / "merge.log"})
    return Scripts(array, merge, logs)


def submit(scripts: Scripts) -> tuple[str, str]:
    """Write both scripts, submit the array, then the merge depending on it; the two job ids."""
    require_tool("sbatch")
    with removed_on_failure([scripts.directory]):
        scripts.directory.mkdir(parents=True, exist_ok=True)
        (scripts.directory / ARRAY_SCRIPT).write_text(scripts.array)
        (scripts.directory / MERGE_SCRIPT).write_text(scripts.merge)
        array = job_id(slurm("sbatch", "--parsable", str(scripts.directory / ARRAY_SCRIPT), hint=SBATCH_REFUSED).stdout)
        merged = slurm(
            "sbatch",
            "--parsable",
            f"--dependency=afterok:{array}",
            "--kill-on-invalid-dep=yes",
            str(scripts.directory / MERGE_SCRIPT),
            check=False,
        )
        if merged.returncode != 0:  # parts nothing would merge: cancelled before they start
            slurm("scancel", array, check=False)
            raise UserError(
                f"sbatch of the merge job failed: {merged.stderr.strip() or merged.stdout.strip()}; "
                f"the array job {array} was cancelled",
                SBATCH_REFUSED,
            )
    return array, job_id(merged.stdout)


def job_id(parsable: str) -> str:
    """`sbatch --parsable` prints `ID` or `ID;CLUSTER`."""
    return parsable.strip().split(";")[0]
