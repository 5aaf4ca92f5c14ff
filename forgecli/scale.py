"""`forge scale plan|run|fit`: a scaling-law study from one command each: an isoFLOP plan for a preset's family,
its runs (here one after another, or as one SLURM array job), and Chinchilla fits of their final losses. The
work is in `engine.scale`; this parses and renders."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from forgecli import slurm as slurm_options
from forgecli.completion import complete_preset
from forgecli.ui import console, err_console, is_interactive, print_json, print_wide, user_errors

if TYPE_CHECKING:
    from engine.scale.plan import Plan
    from engine.scale.study import RunPoint, Unfinished

app = typer.Typer(
    name="scale",
    help="Scaling-law studies: isoFLOP plans for a preset's family, their runs, and fits with confidence intervals.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)


def say(text: str, to: Any = None) -> None:
    (to or console).print(text, markup=False, highlight=False, soft_wrap=True)


def table(title: str) -> Table:
    return Table(
        box=box.SIMPLE_HEAD if is_interactive() else None,
        header_style="bold",
        pad_edge=False,
        title=title,
        title_justify="left",
    )


def sci(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


@app.command("plan")
@user_errors
def plan(
    preset: Path = typer.Argument(..., help="TOML preset the family grows from.", autocompletion=complete_preset),
    budgets: str = typer.Option(..., "--budgets", help="Compute budgets in FLOPs, comma-separated: 1e17,3e17,1e18."),
    sizes_per_budget: int = typer.Option(5, "--sizes-per-budget", help="Model sizes trained per budget (3 or more)."),
    span: float = typer.Option(
        3.0, "--span", help="The sizes run from the expected optimum ÷ span to × span (evenly in log N)."
    ),
    tokens_per_param: float = typer.Option(
        20.0, "--tokens-per-param", help="Where the expected optimum lies: tokens per parameter (Chinchilla: ~20)."
    ),
    world_size: int = typer.Option(
        1, "--world-size", min=1, help="Processes each run will use (its tokens per step count them)."
    ),
    out: Path = typer.Option(..., "--out", help="Plan folder: plan.json, configs/, and later runs/."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
) -> None:
    """Write an isoFLOP plan: for each budget, sizes of the preset's family around the budget's expected
    optimum (~20 tokens per parameter), each trained on budget ÷ FLOPs-per-token tokens, as one config per point
    (a whole preset `forge train` takes, evaluating its held-out loss at the last step) plus plan.json.

    [bold]Examples[/bold]

      forge scale plan presets/125m.toml --budgets 1e18,3e18,1e19 --world-size 8 --out studies/125m

      forge scale plan presets/debug.toml --budgets 5e12,1e13 --sizes-per-budget 3 --span 3 --tokens-per-param 0.05 --out studies/debug

    """
    from engine.config import load_job_config
    from engine.scale.plan import make_plan, parse_budgets, write_plan

    cfg = load_job_config(preset)
    made, configs = make_plan(
        cfg, str(preset), parse_budgets(budgets), sizes_per_budget, span, world_size, tokens_per_param
    )
    write_plan(out, made, configs)
    if as_json:
        sys.stdout.write(made.to_json())
        return
    print_wide(plan_table(made))
    say(f"plan: {out / 'plan.json'} ({len(made.points)} runs, configs in {out / 'configs'})")
    say(f"next: forge scale run {shlex.quote(str(out))}")


def plan_table(made: Plan) -> Table:
    from engine.scale.plan import human

    shown = table(f"isoFLOP plan: {made.tokens_per_step:,} tokens per step, world size {made.world_size}")
    for column in ("point", "budget", "shape", "N", "D", "D/N", "steps", "C (Forge)", "6·N·D"):
        shown.add_column(column, justify="left" if column in ("point", "shape") else "right")
    for p in made.points:
        shown.add_row(
            escape(p.name),
            sci(p.budget),
            f"{p.dim}×{p.n_layers}, {p.n_heads}/{p.n_kv_heads} heads",
            human(p.params),
            human(p.tokens),
            f"{p.tokens / p.params:.3g}",
            str(p.max_steps),
            sci(p.flops),
            sci(p.flops_6nd),
        )
    return shown


SLURM_ONLY = (
    "nodes",
    "gpus_per_node",
    "ntasks_per_node",
    "cpus_per_task",
    "time_limit",
    "partition",
    "account",
    "qos",
    "job_name",
    "signal_lead",
    "max_requeues",
    "sbatch_arg",
    "after",
    "after_ok",
    "template",
    "dry_run",
    "as_json",
)


@app.command("run")
@user_errors
def run(
    ctx: typer.Context,
    plan_dir: Path = typer.Argument(..., help="Plan folder written by `forge scale plan`."),
    slurm: bool = typer.Option(False, "--slurm", help="Submit the unfinished points as one SLURM array job."),
    nodes: slurm_options.Nodes = 1,
    gpus_per_node: slurm_options.GpusPerNode = 0,
    ntasks_per_node: slurm_options.NtasksPerNode = None,
    cpus_per_task: slurm_options.CpusPerTask = 1,
    time_limit: slurm_options.TimeLimit = None,
    partition: slurm_options.Partition = None,
    account: slurm_options.Account = None,
    qos: slurm_options.Qos = None,
    job_name: slurm_options.JobName = None,
    signal_lead: slurm_options.SignalLead = 600,
    max_requeues: slurm_options.MaxRequeues = 3,
    sbatch_arg: slurm_options.SbatchArgs = [],  # noqa: B006 (typer reads the default; nothing mutates it)
    after: slurm_options.After = None,
    after_ok: slurm_options.AfterOk = None,
    template: slurm_options.Template = None,
    dry_run: slurm_options.DryRun = False,
    as_json: bool = typer.Option(False, "--json", help="With --slurm: print the job id and run directories as JSON."),
) -> None:
    """Train the plan's points into PLAN_DIR/runs/, one after another; finished points are skipped and an
    interrupted one continues from its newest checkpoint. With --slurm (and `forge slurm submit`'s options),
    the unfinished points go to SLURM as one array job instead, each task preemption-safe as `forge slurm` is.

    [bold]Examples[/bold]

      forge scale run studies/debug

      forge scale run studies/125m --slurm --gpus-per-node 8 --time 12:00:00 --partition gpu

    """
    from engine.scale.plan import read_plan

    if not slurm:
        check_no_slurm_options(ctx)
    made = read_plan(plan_dir)
    if not slurm:
        run_here(plan_dir, made)
        return
    from engine.scale.run import slurm_submission
    from engine.slurm.jobs import submit as submit_job
    from engine.slurm.render import DEFAULT_TEMPLATE, SlurmRequest

    req = SlurmRequest(
        preset=plan_dir,  # each array task sets its own point's config (engine.scale.run.slurm_submission)
        overrides=[],
        run_dir=plan_dir,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        ntasks_per_node=ntasks_per_node,
        cpus_per_task=cpus_per_task,
        time=time_limit,
        partition=partition,
        account=account,
        qos=qos,
        job_name=job_name or f"scale-{plan_dir.resolve().name}",
        signal_lead=signal_lead,
        max_requeues=max_requeues,
        sbatch_args=sbatch_arg,
        after=after,
        after_ok=after_ok,
    )
    sub, todo = slurm_submission(plan_dir, made, req, template or DEFAULT_TEMPLATE, ["forge", *sys.argv[1:]])
    if dry_run:
        sys.stdout.write(sub.script)
        return
    job_id = submit_job(sub)
    if as_json:
        print_json({"job_id": job_id, "script": str(sub.script_path), "run_dirs": [str(d) for d in sub.run_dirs]})
        return
    skipped = len(made.points) - len(todo)
    say(
        f"submitted job {job_id}: {len(todo)} array tasks"
        + (f" ({skipped} points already finished)" if skipped else "")
    )
    say(f"script: {sub.script_path}")
    say(
        f"follow: forge runs {shlex.quote(str(plan_dir / 'runs'))}   then: forge scale fit {shlex.quote(str(plan_dir))}"
    )


def check_no_slurm_options(ctx: typer.Context) -> None:
    """A submission's options without --slurm would be read by nothing: say so rather than ignore them."""
    from engine.errors import UserError

    flags = {p.name: p.opts[0] for p in ctx.command.params}
    given = [flags[name] for name in SLURM_ONLY if ctx.get_parameter_source(name).name != "DEFAULT"]
    if given:
        raise UserError(f"{', '.join(given)}: only with --slurm", "add --slurm, or drop them to train here")


def run_here(plan_dir: Path, made: Plan) -> None:
    """Each unfinished point in turn, in this process, with `forge train`'s output."""
    from engine.config import load_job_config
    from engine.scale.run import check_local, point_states
    from forgecli.train import run_training

    check_local(made)
    states = point_states(plan_dir, made)
    for index, state in enumerate(states, 1):
        head = f"[{index}/{len(states)}] {state.point.name}"
        if not state.pending:
            say(f"{head}: complete, skipped")
            continue
        say(f"{head}: {'continuing' if state.state == 'resume' else 'training'} ({state.point.max_steps} steps)")
        run_training(load_job_config(state.config), state.run_dir, as_json=False)
    say(f"all {len(states)} points complete; next: forge scale fit {shlex.quote(str(plan_dir))}")


@app.command("fit")
@user_errors
def fit(
    run_dirs: list[Path] = typer.Argument(..., help="Run directories of the study (a plan folder: all its runs)."),
    plot: Path | None = typer.Option(
        None,
        "--plot",
        help="Write isoFLOP curves, the compute-optimal frontier and loss vs compute to this PNG "
        "(needs matplotlib: pip install 'forge-lm\\[scale]').",
    ),
    predict: Path | None = typer.Option(
        None, "--predict", help="Predict the final loss of this preset (same family), with its interval."
    ),
    tokens: float | None = typer.Option(
        None, "--tokens", help="With --predict: tokens it trains on. Default: the preset's max_steps × tokens per step."
    ),
    bootstrap: int = typer.Option(200, "--bootstrap", min=10, help="Resamples for the confidence intervals."),
    seed: int = typer.Option(0, "--seed", help="Seed of the bootstrap's resampling."),
    strict: bool = typer.Option(False, "--strict", help="Fail (exit 2) if any run has not finished."),
    as_json: bool = typer.Option(False, "--json", help="Print runs, fits and prediction as JSON."),
) -> None:
    """Fit scaling laws to the runs' final held-out losses: Chinchilla's approach 2 (a parabola in log N per
    budget → N_opt ∝ C^a, D_opt ∝ C^b) and approach 3 (L = E + A/N^α + B/D^β, Huber loss on log L, L-BFGS-B from
    a grid, bootstrap 95% intervals). Unfinished runs are listed and left out.

    [bold]Examples[/bold]

      forge scale fit studies/125m

      forge scale fit studies/125m --plot scaling.png --predict presets/1.3b.toml --tokens 2.6e10 --json

    """
    from engine.errors import UserError
    from engine.scale.study import collect, fit_study, prediction_target, report

    if tokens is not None and predict is None:
        raise UserError("--tokens is the prediction's token count", "add --predict PRESET")
    try:
        import scipy  # noqa: F401 (the fits' optimizer; an optional dependency)
    except ImportError:
        raise UserError(
            "forge scale fit needs SciPy, which is not installed", "pip install 'forge-lm[scale]'"
        ) from None
    points, unfinished = collect(run_dirs, strict)
    target = prediction_target(predict, tokens, [Path(points[0].path)]) if predict else None
    fits = fit_study(points, bootstrap, seed)
    out = report(points, unfinished, fits)
    if target is not None:
        loss, (low, high) = fits["approach3"].predict(target["params"], target["tokens"])
        out["prediction"] = {**target, "loss": loss, "interval": [low, high]}
    if plot is not None:
        from forgecli.scale_plot import save_scaling_plot

        save_scaling_plot(points, fits, out.get("prediction"), plot)
        out["plot"] = str(plot)
    if as_json:
        print_json(out)
        return
    show_fit(points, unfinished, out)


def show_fit(points: list[RunPoint], unfinished: list[Unfinished], out: dict[str, Any]) -> None:
    from engine.scale.plan import human

    runs = table(f"{len(points)} finished runs: final held-out loss")
    for column in ("run", "N", "D", "C (Forge)", "6·N·D", "loss"):
        runs.add_column(column, justify="left" if column == "run" else "right")
    for p in (
        points[i]
        for budget in out["approach2"]["budgets"]
        for i in sorted(budget["runs"], key=lambda i: points[i].params)
    ):
        runs.add_row(escape(p.name), human(p.params), human(p.tokens), sci(p.flops), sci(p.flops_6nd), f"{p.loss:.4f}")
    print_wide(runs)
    for u in unfinished:
        say(f"left out (not finished): {u.path}: {u.status}, {u.detail}", err_console)

    two = out["approach2"]
    shown = table("approach 2: isoFLOP parabolas")
    for column in ("budget C", "runs", "N_opt", "D_opt", "loss at N_opt", "note"):
        shown.add_column(column, justify="left" if column == "note" else "right")
    for b in two["budgets"]:
        note = b["skipped"] or ("" if b["inside"] else "vertex outside the sizes trained")
        opt = b["params_opt"] is not None
        shown.add_row(
            sci(b["flops"]),
            str(len(b["runs"])),
            human(b["params_opt"]) if opt else "-",
            human(b["tokens_opt"]) if opt else "-",
            f"{b['loss_opt']:.4f}" if opt else "-",
            note,
        )
    print_wide(shown)
    if two["skipped"]:
        say(f"approach 2: no exponents: {two['skipped']}")
    else:
        say(f"approach 2: N_opt ∝ C^{two['a']:.3f}, D_opt ∝ C^{two['b']:.3f}")

    three = out["approach3"]
    law, ci = three["law"], three["intervals"]
    level = f"{three['confidence']:.0%}"
    params = table("approach 3: L(N, D) = E + A/N^α + B/D^β")
    for column in ("parameter", "value", f"{level} low", f"{level} high"):
        params.add_column(column, justify="left" if column == "parameter" else "right")
    for name, label in (("E", "E"), ("A", "A"), ("B", "B"), ("alpha", "α"), ("beta", "β")):
        params.add_row(label, f"{law[name]:.4g}", f"{ci[name][0]:.4g}", f"{ci[name][1]:.4g}")
    params.add_row("a = β/(α+β)", f"{three['a']:.4g}", f"{ci['a'][0]:.4g}", f"{ci['a'][1]:.4g}")
    print_wide(params)
    if "prediction" in out:
        p = out["prediction"]
        low, high = p["interval"]
        say(
            f"prediction for {p['preset']} (N = {human(p['params'])}, D = {human(p['tokens'])}): "
            f"loss {p['loss']:.4f} ({level} interval {low:.4f} to {high:.4f})"
        )
    if "plot" in out:
        say(f"plot: {out['plot']}")
