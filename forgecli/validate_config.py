"""`forge validate-config`: load and check a preset without training (never imports torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from forgecli.completion import complete_preset
from forgecli.overrides import collect_overrides
from forgecli.ui import console, print_json, print_wide, show_config_warnings, user_errors


@user_errors
def validate_config(
    ctx: typer.Context,
    preset: Path = typer.Argument(..., help="TOML preset to check.", autocompletion=complete_preset),
    world_size: int = typer.Option(1, "--world-size", help="Number of processes the layout must fit."),
    as_json: bool = typer.Option(False, "--json", help="Print the resolved config and estimates as JSON."),
    gpu_memory_gib: float | None = typer.Option(
        None, "--gpu-memory-gib", min=0.0, help="Memory of one GPU: says whether each pipeline stage fits in it."
    ),
    explain: bool = typer.Option(
        False, "--explain", help="Show which file (the preset or one it includes) set each field, or override."
    ),
) -> None:
    """Check a preset and its overrides: every error at once (exit 2), warnings, the resolved config, size and cost.

    Overrides as --section.key=value, values as TOML literals (--optimizer.betas=[0.9,0.95]).

    [bold]Examples[/bold]

      forge validate-config presets/debug.toml

      forge validate-config presets/debug.toml --model.n_layers=8 --world-size 1 --json

      forge validate-config presets/debug.toml --world-size 8 --distributed.tp=2 --gpu-memory-gib 80

      forge validate-config my_run.toml --explain

    """
    from engine.config import load_job_config
    from engine.config.loader import field_sources
    from engine.errors import UserError
    from engine.parallel.memory import checkpoint_bytes
    from engine.plan import resolve
    from engine.plan.summary import job_summary

    overrides = collect_overrides(ctx.args)
    try:
        job = resolve(load_job_config(preset, overrides), world_size)
        cfg, warnings = job.config, job.warnings
        if cfg.train.hooks:  # found, never imported: importing research code is what training does
            from engine.train.hooks import check_hook_module

            for index, spec in enumerate(cfg.train.hooks):
                check_hook_module(spec, index, None, allow_run_dir_code=True)
        summary = job_summary(job)
        stages = job.memory
        sources = field_sources(cfg, preset, overrides)
    except UserError as err:
        if as_json:  # the errors on stdout for scripts; the panel still goes to stderr, and the exit code is 2
            print_json({"valid": False, "errors": error_rows(err), "warnings": []})
        raise
    if as_json:
        memory = {
            "stages": [stage.as_dict() for stage in stages],
            "gpu_memory_gib": gpu_memory_gib,
            "checkpoint_bytes": checkpoint_bytes(cfg),
        }
        if gpu_memory_gib is not None:
            memory["fits"] = all(stage.total <= gpu_memory_gib * GIB for stage in stages)
        print_json(
            {
                "valid": True,
                "errors": [],
                "config": cfg.model_dump(mode="json"),
                "sources": sources,
                **summary,
                "memory": memory,
                "lr_schedule": lr_schedule(cfg, world_size),
                "warnings": [{"field": w.path, "problem": w.problem, "hint": w.hint} for w in warnings],
            }
        )
        return
    console.print(config_tree(cfg.model_dump(mode="json"), str(preset), sources if explain else None))
    console.print(summary_table(summary))
    print_wide(memory_table(stages, cfg, world_size, gpu_memory_gib))
    console.print(checkpoint_line(checkpoint_bytes(cfg), cfg.checkpoint.keep_last_n))
    if cfg.data.datasets:
        print_wide(phases_table(cfg, world_size))
    console.print(lr_curve(cfg, world_size))
    show_config_warnings(warnings, console)
    console.print("[green]✓ config is valid[/green]" + (f" for world size {world_size}" if world_size > 1 else ""))


def error_rows(err: Any) -> list[dict[str, str | None]]:
    """A UserError as --json's error rows, shaped like its warnings: one per config issue, or the one error
    (no field) when the preset could not be read at all."""
    from engine.errors import ConfigError

    if isinstance(err, ConfigError):
        return [{"field": i.path, "problem": i.problem, "hint": i.hint} for i in err.issues]
    return [{"field": None, "problem": err.message, "hint": err.hint}]


def config_tree(data: dict[str, Any], title: str, sources: dict[str, str] | None = None) -> Tree:
    """The resolved config; with `sources`, each field followed by the file (or override) that set it."""
    tree = Tree(f"[bold]{escape(title)}[/bold]")
    for section, fields in data.items():
        branch = tree.add(f"[cyan]\\[{section}][/cyan]")
        for key, value in fields.items():
            origin = f"  [dim]← {escape(sources[f'{section}.{key}'])}[/dim]" if sources else ""
            branch.add(f"{key} = [magenta]{escape(repr(value))}[/magenta]{origin}")
    return tree


def summary_table(summary: dict[str, Any]) -> Table:
    table = Table(title="Size and cost", show_header=False, expand=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    params = summary["parameters"]
    table.add_row("parameters (total)", human(params["total"]))
    if params["active"] != params["total"]:
        table.add_row("parameters (active per token)", human(params["active"]))
    table.add_row("  embedding table", human(params["embedding"]))
    table.add_row("  transformer blocks + final norm", human(params["blocks"]))
    table.add_row("  output head", human(params["output_head"]) if params["output_head"] else "tied to the embedding")
    moe = " (active)" if params["active"] != params["total"] else ""
    table.add_row(f"training FLOPs per token{moe}", human(summary["flops_per_token"], "FLOP"))
    length = summary.get("length")
    if length is not None:  # the config says its batch or length the recipe way: how it comes out
        table.add_row("global batch (sequences)", f"{length['global_batch_size']:,}")
        table.add_row("  micro-batches per step per rank", f"{length['grad_accum_steps']:,} (derived)")
        if length["batch_ramp"]:
            first = length["batch_ramp"][0]
            table.add_row("  batch ramp", f"from {first['sequences']:,} sequences: see the lr table")
        source = length.get("max_steps_from")
        table.add_row("steps", f"{length['max_steps']:,}" + (f" (from {source})" if source else ""))
    table.add_row("tokens per step (global)", f"{summary['tokens_per_step']:,}")
    table.add_row("training FLOPs per step", human(summary["flops_per_step"], "FLOP"))
    table.add_row("total tokens", f"{summary['total_tokens']:,}")
    if "mup" in summary:
        mup_rows(table, summary["mup"])
    return table


def mup_rows(table: Table, mup: dict[str, Any]) -> None:
    """μP's multipliers (engine/model/mup.py): the scalars, then each group of parameters with its init std
    and learning-rate multipliers."""
    table.add_row("μP width multiplier", f"{mup['width_mult']:g} (dim / mup_base_dim {mup['base_dim']})")
    table.add_row("  output logit multiplier", f"{mup['output_multiplier']:g}")
    table.add_row("  attention scale (q·k ×)", f"{mup['attention_scale']:g} (1/head_dim)")
    for group in mup["groups"]:
        table.add_row(
            f"  init std ×{group['init_std_mult']:.4g}, lr ×{group['lr_mult']:.4g} (muon ×{group['muon_lr_mult']:.4g})",
            escape(", ".join(group["params"])),
        )


GIB = 2**30


def layout(cfg: Any, world_size: int) -> str:
    d = cfg.distributed
    return (
        f"dp_replicate={d.dp_replicate} × dp_shard={d.resolved_dp_shard(world_size)} × tp={d.tp} × pp={d.pp} "
        f"× cp={d.cp} = {world_size}" + (f", experts over ep={d.ep}" if d.ep > 1 else "")
    )


def memory_table(stages: list[Any], cfg: Any, world_size: int, gpu_memory_gib: float | None) -> Table:
    """Estimated GiB per rank, one row per pipeline rank (engine.parallel.memory explains each column); "in
    flight" is the number of micro-batch forwards whose activations the rank holds at its peak."""
    precision = cfg.train.mixed_precision
    dtype = "bf16 (auto: as on a bf16 GPU; a CPU computes in fp32)" if precision == "auto" else precision
    table = Table(
        title=f"Estimated memory per rank, GiB ({layout(cfg, world_size)})",
        expand=False,
        caption=f"analytic; total = estimated peak on the device; compute in {dtype}, weights "
        f"{cfg.optimizer.weight_dtype}, optimizer state {cfg.optimizer.state_dtype}; keep ~10-15 % headroom for the CUDA context, fragmentation and "
        "communication buffers" + host_caption(stages, cfg),
    )
    columns = ["pp rank", "blocks", "in flight", "params", "grads", "optimizer", "activations", "buffers", "total"]
    for name in columns + (["host"] if offloads(stages) else []):
        table.add_column(name, justify="right")
    if gpu_memory_gib is not None:
        table.add_column(f"fits {gpu_memory_gib:g} GiB")
    for s in stages:
        row = [
            str(s.pp_rank),
            ", ".join(f"{first}-{last}" for first, last in s.blocks),
            str(s.microbatches_in_flight),
            *(f"{value / GIB:.2f}" for value in (s.params, s.grads, s.optimizer, s.activations, s.buffers, s.total)),
        ]
        if offloads(stages):
            row.append(f"{s.host / GIB:.2f}")
        if gpu_memory_gib is not None:
            row.append("[green]yes[/green]" if s.total <= gpu_memory_gib * GIB else "[red]no[/red]")
        table.add_row(*row)
    return table


def host_caption(stages: list[Any], cfg: Any) -> str:
    """What the host column holds: offloaded activations, and with distributed.cpu_offload the weights, their
    gradients and the optimizer state."""
    if not offloads(stages):
        return ""
    held = ["activations"] if cfg.train.activation_offload else []
    held += ["params, grads and optimizer state"] if cfg.distributed.cpu_offload else []
    return f"; host = {' and '.join(held)} offloaded to host memory"


def offloads(stages: list[Any]) -> bool:
    """Whether any rank keeps something in host memory (the table then has a host column)."""
    return any(stage.host for stage in stages)


def checkpoint_line(size: int, keep_last_n: int | None) -> str:
    """The disk one checkpoint takes, and the rotation's (a full disk mid-save stops the run)."""
    line = f"checkpoint size: {disk_size(size)} each on disk (weights and optimizer state)"
    if keep_last_n is not None:
        line += f"; keep_last_n={keep_last_n} holds {disk_size(keep_last_n * size)}, plus any kept by checkpoint.keep"
    return line


def disk_size(size: int) -> str:
    return f"{size / GIB:.2f} GiB" if size >= GIB // 8 else f"{size / 2**20:.1f} MiB"


SPARK = "▁▂▃▄▅▆▇█"


def phases_table(cfg: Any, world_size: int) -> Table:
    """The data mixture's phases: their steps, lr scale, and each source's share (after temperature) and
    expected tokens."""
    from engine.data.batch_plan import batch_plan
    from engine.data.mixture import phase_table

    names = [s.name for s in cfg.data.datasets]
    table = Table(title=f"Data mixture (mix_temperature = {cfg.data.mix_temperature:g})", header_style="bold")
    for column in ("steps", "lr scale", *names):
        table.add_column(column, justify="right")
    for row in phase_table(cfg.data, cfg.train.max_steps, batch_plan(cfg, world_size).tokens_before):
        shares = [row["sources"][n] for n in names]
        table.add_row(
            f"{row['first_step']:,}–{row['last_step']:,}",
            f"{row['lr_scale']:g}",
            *(f"{s['probability']:.1%} · {human(s['tokens'])} tok" for s in shares),
        )
    return table


def lr_schedule(cfg: Any, world_size: int = 1) -> list[dict[str, float]]:
    """The learning rate at the steps where the schedule changes phase (steps counted from 1, as in the
    metrics); under a batch ramp also where the batch rises, with each row's global batch (sequences) and
    the tokens trained on before the step."""
    from engine.data.batch_plan import batch_plan
    from engine.train.schedules import key_steps, learning_rate

    steps = set(key_steps(cfg, world_size))
    plan = batch_plan(cfg, world_size)
    if plan.ramp is None:
        return [{"step": s + 1, "lr": learning_rate(cfg, s, world_size)} for s in sorted(steps)]
    steps |= {first for first, _, _ in plan.segments if first < cfg.train.max_steps}
    return [
        {
            "step": s + 1,
            "lr": learning_rate(cfg, s, world_size),
            "batch": plan.sequences(s),
            "tokens_before": plan.tokens_before(s),
        }
        for s in sorted(steps)
    ]


def sparkline(cfg: Any, width: int = 64, world_size: int = 1) -> str:
    """The whole run's learning rate as one line of block characters, scaled to optimizer.lr."""
    from engine.train.schedules import learning_rate

    last = cfg.train.max_steps - 1
    width = min(width, last + 1)
    steps = [round(i * last / max(width - 1, 1)) for i in range(width)]
    levels = [learning_rate(cfg, s, world_size) / cfg.optimizer.lr for s in steps]
    return "".join(SPARK[min(round(level * (len(SPARK) - 1)), len(SPARK) - 1)] for level in levels)


def lr_curve(cfg: Any, world_size: int = 1) -> Group:
    """A sparkline of the whole run over a table of the learning rate where its phases change; under a batch
    ramp the table has the global batch and the tokens seen beside the lr."""
    line = sparkline(cfg, world_size=world_size)
    last = f"{cfg.train.max_steps:,}"
    points = lr_schedule(cfg, world_size)
    ramp = bool(points) and "batch" in points[0]
    table = Table(show_header=True, header_style="bold", expand=False)
    table.add_column("step", justify="right")
    table.add_column("lr", justify="right")
    if ramp:
        table.add_column("batch (sequences)", justify="right")
        table.add_column("tokens before", justify="right")
    for point in points:
        extra = [f"{point['batch']:,}", f"{point['tokens_before']:,}"] if ramp else []
        table.add_row(f"{point['step']:,}", f"{point['lr']:.3e}", *extra)
    unit = " in tokens" if cfg.scheduler.unit == "tokens" else ""
    return Group(
        Text(
            f"Learning rate ({cfg.scheduler.name} schedule{unit}, {cfg.optimizer.name}): 0 … {cfg.optimizer.lr:g}",
            style="bold",
        ),
        Text(line, style="cyan"),
        Text("step 1" + last.rjust(max(len(line) - len("step 1"), len(last) + 1))),
        table,
    )


def human(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}{unit}".rstrip()
    return f"{n:g} {unit}".rstrip()
