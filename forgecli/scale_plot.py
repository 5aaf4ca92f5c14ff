"""`forge scale fit --plot`: the study in three panels (matplotlib, optional like `forge runs compare --plot`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from engine.scale.study import RunPoint


def save_scaling_plot(points: list[RunPoint], fits: dict[str, Any], prediction: dict | None, path: Path) -> Figure:
    """isoFLOP curves (loss against N per budget, with each parabola and its vertex); the compute-optimal
    frontier (approach 2's vertices and power law, approach 3's N_opt(C)); loss against compute (the runs,
    approach 3's lowest loss for each C, and the prediction with its interval)."""
    from engine.errors import UserError

    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed, and none is opened
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(
            "--plot needs matplotlib, which is not installed",
            "pip install 'forge-lm[plot]' (or pip install matplotlib)",
        ) from None
    n = np.array([p.params for p in points], dtype=np.float64)
    c = np.array([p.flops for p in points])
    loss = np.array([p.loss for p in points])
    two, three = fits["approach2"], fits["approach3"]
    figure = Figure(figsize=(15, 4.8), layout="constrained")
    isoflop, frontier, compute = figure.subplots(1, 3)
    colors = matplotlib.colormaps["viridis"](np.linspace(0, 0.9, max(len(two.budgets), 1)))

    for budget, color in zip(two.budgets, colors):
        runs = budget.runs
        isoflop.scatter(n[runs], loss[runs], color=color, label=f"C = {budget.flops:.2g}")
        if budget.coefficients:
            c0, c1, c2 = budget.coefficients
            x = np.linspace(np.log(n[runs]).min() - 0.2, np.log(n[runs]).max() + 0.2, 100)
            isoflop.plot(np.exp(x), c0 + c1 * x + c2 * x**2, color=color, lw=1)
        if budget.params_opt is not None:
            isoflop.scatter([budget.params_opt], [budget.loss_opt], color=color, marker="*", s=140, edgecolor="k")
    isoflop.set(xscale="log", xlabel="parameters N", ylabel="final held-out loss", title="isoFLOP profiles")
    isoflop.legend(fontsize="small")

    span = np.geomspace(c.min() / 3, c.max() * 30, 100)
    usable = [b for b in two.budgets if b.params_opt is not None]
    if usable:
        frontier.scatter(
            [b.flops for b in usable], [b.params_opt for b in usable], color="C0", label="approach 2 vertices"
        )
    if two.a is not None:
        log_c = np.log([b.flops for b in usable])
        slope, intercept = np.polyfit(log_c, np.log([b.params_opt for b in usable]), 1)
        frontier.plot(span, np.exp(intercept + slope * np.log(span)), color="C0", label=f"approach 2: C^{two.a:.3f}")
    # Approach 3's optimum is along C = 6·N·D; Forge's counts are put on that axis by their median ratio to 6·N·D.
    ratio = float(np.median([p.flops / p.flops_6nd for p in points]))
    frontier.plot(
        span, three.law.optimal_params(span / ratio), color="C3", ls="--", label=f"approach 3: C^{three.law.a:.3f}"
    )
    frontier.set(xscale="log", yscale="log", xlabel="FLOPs C (Forge)", ylabel="N_opt", title="compute-optimal size")
    frontier.legend(fontsize="small")

    compute.scatter(c, loss, color="C0", s=14, label="runs")
    n_opt = three.law.optimal_params(span / ratio)
    compute.plot(span, three.law.loss(n_opt, span / ratio / (6 * n_opt)), color="C3", label="approach 3 at N_opt")
    if prediction is not None:
        low, high = prediction["interval"]
        compute.errorbar(
            [prediction["flops"]],
            [prediction["loss"]],
            yerr=[[prediction["loss"] - low], [high - prediction["loss"]]],
            fmt="D",
            color="C1",
            capsize=4,
            label="prediction",
        )
    shown = [*loss, *([prediction["loss"]] if prediction else [])]
    compute.set_ylim(min(shown) - 0.5 * np.ptp(shown) - 0.05, max(shown) + 0.5 * np.ptp(shown) + 0.05)
    compute.set(xscale="log", xlabel="FLOPs C (Forge)", ylabel="final held-out loss", title="loss vs compute")
    compute.legend(fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    return figure
