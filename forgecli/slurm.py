"""`forge slurm submit|status|logs|cancel`: run on a SLURM cluster and follow the job across requeues.
The work is in `engine.slurm`; this parses and renders."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from engine.data import DEFAULT_SHARD_TOKENS
from forgecli.completion import OverrideCommand, complete_preset
from forgecli.overrides import collect_overrides
from forgecli.train import AllowCode
from forgecli.ui import console, print_json, user_errors

app = typer.Typer(
    name="slurm",
    help="Submit training to SLURM (preemption-safe, sweeps, chains) and follow, stop jobs across requeues; tokenize on many nodes.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)


# The options of a submission, shared with `forge scale run --slurm`.
Nodes = Annotated[int, typer.Option("--nodes", min=1, help="Nodes to allocate.")]
GpusPerNode = Annotated[int, typer.Option("--gpus-per-node", min=0, help="GPUs per node (0 = a CPU job).")]
NtasksPerNode = Annotated[
    int | None,
    typer.Option("--ntasks-per-node", min=1, help="Ranks per node. Default: one per GPU (1 for a CPU job)."),
]
CpusPerTask = Annotated[int, typer.Option("--cpus-per-task", min=1, help="CPU cores per rank (OMP_NUM_THREADS).")]
TimeLimit = Annotated[str | None, typer.Option("--time", help="Time limit, e.g. 24:00:00. Default: the partition's.")]
Partition = Annotated[str | None, typer.Option("--partition")]
Account = Annotated[str | None, typer.Option("--account")]
Qos = Annotated[str | None, typer.Option("--qos")]
JobName = Annotated[str | None, typer.Option("--job-name", help="Default: the run directory's name.")]
SignalLead = Annotated[
    int,
    typer.Option("--signal-lead", min=1, help="Seconds before the time limit the ranks get SIGUSR1 to save and stop."),
]
MaxRequeues = Annotated[
    int, typer.Option("--max-requeues", min=0, help="Times the job requeues itself after a preemption.")
]
SbatchArgs = Annotated[
    list[str], typer.Option("--sbatch-arg", help="Extra sbatch option, passed through (repeatable).")
]
After = Annotated[str | None, typer.Option("--after", help="Start after this job ends (any outcome).")]
AfterOk = Annotated[str | None, typer.Option("--after-ok", help="Start after this job succeeds.")]
Template = Annotated[
    Path | None, typer.Option("--template", help="sbatch template (Jinja2). Default: templates/slurm.sbatch.")
]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Check and print the script; submit nothing.")]


def say(text: str) -> None:
    console.print(text, markup=False, highlight=False, soft_wrap=True)


@app.command("submit", cls=OverrideCommand, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@user_errors
def submit(
    ctx: typer.Context,
    preset: Path = typer.Argument(
        ..., help="TOML preset; overrides follow as --section.key=value.", autocompletion=complete_preset
    ),
    nodes: Nodes = 1,
    gpus_per_node: GpusPerNode = 0,
    ntasks_per_node: NtasksPerNode = None,
    cpus_per_task: CpusPerTask = 1,
    time_limit: TimeLimit = None,
    partition: Partition = None,
    account: Account = None,
    qos: Qos = None,
    job_name: JobName = None,
    run_dir: Path | None = typer.Option(
        None, "--run-dir", help="Run directory (a sweep: the folder of its points). Default: runs/<preset name>."
    ),
    signal_lead: SignalLead = 600,
    max_requeues: MaxRequeues = 3,
    sbatch_arg: SbatchArgs = [],  # noqa: B006 (typer reads the default; nothing mutates it)
    sweep: list[str] = typer.Option([], "--sweep", help="section.key=v1,v2,… (repeatable): one array task per point."),
    after: After = None,
    after_ok: AfterOk = None,
    template: Template = None,
    dry_run: DryRun = False,
    as_json: bool = typer.Option(False, "--json", help="Print the job id and run directories as JSON."),
    allow_code: AllowCode = False,
) -> None:
    """Submit a training job: checked for its world size, wired for preemption, requeued on its own.

    [bold]Examples[/bold]

      forge slurm submit presets/debug.toml --nodes 4 --gpus-per-node 8 --time 24:00:00 --partition gpu

      forge slurm submit presets/debug.toml --ntasks-per-node 2 --train.max_steps=100 --dry-run

      forge slurm submit presets/debug.toml --gpus-per-node 8 --sweep optimizer.lr=1e-3,3e-4 --after-ok 1234

    """
    from engine.config import load_job_config
    from engine.slurm.jobs import prepare
    from engine.slurm.jobs import submit as submit_job
    from engine.slurm.render import DEFAULT_TEMPLATE, SlurmRequest
    from engine.train.run_dir import is_saved_config, refuse_saved_code

    overrides = collect_overrides(ctx.args)
    if is_saved_config(preset):  # the job's `forge train` would refuse it in the log: refuse it now
        refuse_saved_code(load_job_config(preset, overrides), overrides, preset, allow_code)
    req = SlurmRequest(
        preset=preset.resolve(),
        overrides=overrides,
        run_dir=(run_dir or Path("runs") / preset.stem).resolve(),
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        ntasks_per_node=ntasks_per_node,
        cpus_per_task=cpus_per_task,
        time=time_limit,
        partition=partition,
        account=account,
        qos=qos,
        job_name=job_name,
        signal_lead=signal_lead,
        max_requeues=max_requeues,
        sbatch_args=sbatch_arg,
        sweep=sweep,
        after=after,
        after_ok=after_ok,
        allow_code=allow_code,
    )
    sub = prepare(req, template or DEFAULT_TEMPLATE, ["forge", *sys.argv[1:]])
    if dry_run:
        sys.stdout.write(sub.script)
        return
    job_id = submit_job(sub)
    if as_json:
        print_json({"job_id": job_id, "script": str(sub.script_path), "run_dirs": [str(d) for d in sub.run_dirs]})
        return
    say(f"submitted job {job_id} ({len(sub.points)} array tasks)" if sub.points else f"submitted job {job_id}")
    say(f"script: {sub.script_path}")
    for run in sub.run_dirs:
        target = shlex.quote(str(run))
        say(
            f"follow: forge slurm status {target}   forge slurm logs {target} -f   forge slurm cancel {target} --graceful"
        )


@app.command("tokenize")
@user_errors
def tokenize(
    inputs: list[str] = typer.Argument(
        ..., metavar="INPUT", show_default=False, help="What forge tokenize reads: files, directories, or hf:NAME."
    ),
    out: Path = typer.Option(..., "--out", "-o", help="New directory for the merged data set."),
    num_shards: int = typer.Option(..., "--num-shards", min=1, help="Parts: array tasks, one machine each."),
    tokenizer: Path = typer.Option(..., "--tokenizer", help="The tokenizer.json every part encodes with."),
    eos_token: str | None = typer.Option(None, "--eos-token", help="As for forge tokenize."),
    text_field: str = typer.Option("text", "--text-field", help="As for forge tokenize."),
    shard_tokens: int = typer.Option(DEFAULT_SHARD_TOKENS, "--shard-tokens", help="Tokens per shard of each part."),
    hf_config: str | None = typer.Option(None, "--hf-config", help="hf:NAME only, as for forge tokenize."),
    split: str | None = typer.Option(None, "--split", help="hf:NAME only, as for forge tokenize."),
    revision: str | None = typer.Option(None, "--revision", help="hf:NAME only, as for forge tokenize."),
    parts: Path | None = typer.Option(
        None, "--parts", help="Directory of the parts and the jobs' scripts and logs. Default: OUT.parts beside OUT."
    ),
    cpus_per_task: int = typer.Option(1, "--cpus-per-task", min=1, help="CPU cores per part (the encoder's threads)."),
    time_limit: str | None = typer.Option(None, "--time", help="Time limit of each job, e.g. 12:00:00."),
    partition: str | None = typer.Option(None, "--partition"),
    account: str | None = typer.Option(None, "--account"),
    qos: str | None = typer.Option(None, "--qos"),
    job_name: str | None = typer.Option(None, "--job-name", help="Default: tokenize-<OUT's name>."),
    sbatch_arg: list[str] = typer.Option([], "--sbatch-arg", help="Extra sbatch option, passed through (repeatable)."),
    template: Path | None = typer.Option(
        None, "--template", help="sbatch template (Jinja2). Default: templates/slurm_tokenize.sbatch."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check and print both scripts; submit nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print the job ids and directories as JSON."),
) -> None:
    """Tokenize on many machines: the parts as one array job, then one job that merges them into OUT.

    [bold]Examples[/bold]

      forge slurm tokenize corpus/ --tokenizer tok.json --num-shards 16 --cpus-per-task 32 --out data/corpus

      forge slurm tokenize corpus/ --tokenizer tok.json --num-shards 4 --out data/corpus --dry-run
    """
    from engine.slurm.tokenize import TEMPLATE, TokenizeJob, prepare
    from engine.slurm.tokenize import submit as submit_tokenize

    job = TokenizeJob(
        inputs=inputs,
        out=out.resolve(),
        count=num_shards,
        tokenizer=tokenizer.resolve(),
        eos_token=eos_token,
        text_field=text_field,
        shard_tokens=shard_tokens,
        hf_config=hf_config,
        split=split,
        revision=revision,
        parts=parts.resolve() if parts else None,
        cpus_per_task=cpus_per_task,
        time=time_limit,
        partition=partition,
        account=account,
        qos=qos,
        job_name=job_name,
        sbatch_args=sbatch_arg,
    )
    scripts = prepare(job, template or TEMPLATE)
    if dry_run:
        sys.stdout.write(scripts.dry_run_text())
        return
    array, merge = submit_tokenize(scripts)
    if as_json:
        print_json(
            {
                "array_job": array,
                "merge_job": merge,
                "parts": str(job.parts_dir),
                "out": str(job.out),
                "count": num_shards,
            }
        )
        return
    say(f"submitted array job {array} ({num_shards} parts into {job.parts_dir}) and merge job {merge} (after it)")
    say(f"logs: {scripts.directory}   data set when done: {job.out}")


@app.command("status")
@user_errors
def status(
    target: Path = typer.Argument(..., help="Run directory, or a job id."),
    as_json: bool = typer.Option(False, "--json", help="Print the status as JSON."),
) -> None:
    """State, elapsed time, restarts, nodes and the last logged step and loss of a job.

    [bold]Examples[/bold]

      forge slurm status runs/debug

      forge slurm status 1234 --json
    """
    from engine.slurm.jobs import job_status, run_dir_of

    info = job_status(run_dir_of(str(target)))
    if as_json:
        print_json(info)
        return
    last = info["last"]
    say(
        f"job {info['job_id']}: {info['state']}"
        + (f" ({info['reason']})" if info["reason"] not in (None, "None") else "")
    )
    say(f"run directory: {info['run_dir']}")
    say(f"elapsed: {info['elapsed'] or '-'}   restarts: {info['restarts']}   nodes: {info['nodes'] or '-'}")
    say(f"last step: {last['step']}, loss {last['loss']:.4f}" if last else "last step: none logged yet")
    if info["outcome"]:
        say(f"outcome: {info['outcome']}")
    for attempt in info["attempts"]:
        end = f"{attempt['outcome']} (exit {attempt['exit_code']}) at {attempt['end']}" if attempt["end"] else "running"
        say(f"  attempt {attempt['attempt']}: started {attempt['start']} on {attempt['nodes']}, {end}")


@app.command("logs")
@user_errors
def logs(
    run_dir: Path = typer.Argument(..., help="Run directory of the job."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines until the job has ended."),
) -> None:
    """The job's output, every attempt in order (requeues append to the same log).

    [bold]Examples[/bold]

      forge slurm logs runs/debug -f
    """
    from engine.slurm.jobs import follow as follow_log
    from engine.slurm.jobs import read_log

    if not follow:
        sys.stdout.write(read_log(run_dir))
        return
    try:
        for line in follow_log(run_dir):
            sys.stdout.write(line)
            sys.stdout.flush()
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


@app.command("cancel")
@user_errors
def cancel(
    run_dir: Path = typer.Argument(..., help="Run directory of the job."),
    graceful: bool = typer.Option(
        False, "--graceful", help="Signal the ranks first so they save a checkpoint; cancel only if they do not stop."
    ),
) -> None:
    """Stop a job. --graceful keeps its progress: a checkpoint is taken and the job is not requeued.

    [bold]Examples[/bold]

      forge slurm cancel runs/debug --graceful
    """
    from engine.config import load_job_config
    from engine.slurm.jobs import cancel as cancel_job

    saved = run_dir / "config.toml"  # written when training starts; a job still pending is cancelled at once
    wait = load_job_config(saved).train.shutdown_timeout_sec + 60 if graceful and saved.is_file() else 60
    say(cancel_job(run_dir, graceful, wait))
