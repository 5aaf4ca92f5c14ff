"""Scaling-law fits of final losses (Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models").
numpy and SciPy only.

Approach 2 (isoFLOP profiles): the runs of one budget lie on a parabola in log N; its vertex is that budget's
optimal size N_opt and, along the budget's line of tokens, its D_opt. Power laws through the vertices give
N_opt ∝ C^a and D_opt ∝ C^b.

Approach 3 (parametric): L(N, D) = E + A/N^α + B/D^β, fitted in the log domain. With A = e^a, B = e^b,
E = e^e the model's log loss is LSE(a − α log N, b − β log D, e) and the fit minimizes the Huber loss
(δ = 1e-3) of its residuals against log L with L-BFGS-B, started from the best points of a grid. A bootstrap
(runs resampled with replacement, seeded) refits the law many times: the percentiles of its parameters are
their confidence intervals, and those of its predictions a prediction's interval.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy.optimize import minimize
from scipy.special import logsumexp

from engine.errors import UserError

HUBER_DELTA = 1e-3
# Runs whose FLOPs lie within this factor of a group's smallest count as one budget (plans keep budgets
# ≥ 1.5× apart, and round each run's steps to within 5% of its budget).
GROUP_RATIO = 1.2
# The starting grid of Hoffmann et al.: α, β ∈ {0, 0.5, …, 2}, e ∈ {-1, -0.5, …, 1}, a, b ∈ {0, 5, …, 25}.
GRID_EXPONENTS = np.arange(0.0, 2.01, 0.5)
GRID_E = np.arange(-1.0, 1.01, 0.5)
GRID_AB = np.arange(0.0, 25.01, 5.0)
STARTS = 8  # L-BFGS-B runs from this many of the best grid points
# Bounds on θ = (a, b, e, α, β) far outside any real law (A, B ≤ e^200, E within e^±100, exponents ≤ 20): they
# only keep the fit of degenerate data (too few or too noisy runs: E → 0, A → ∞) finite.
BOUNDS = [(None, 200.0), (None, 200.0), (-100.0, 100.0), (0.0, 20.0), (0.0, 20.0)]
MAX_ITERATIONS = 500  # a clean fit converges in ~150; a degenerate one (E → 0, A → ∞) would wander for thousands
PARAMETERS = ("E", "A", "B", "alpha", "beta")
MIN_RUNS = len(PARAMETERS) + 1  # approach 3 is under-determined with fewer runs than it has parameters + 1
MIN_SIZES = 3  # a parabola per budget
CONFIDENCE = 0.95


@dataclass
class Law:
    """L(N, D) = E + A/N^α + B/D^β."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, n: np.ndarray | float, d: np.ndarray | float) -> np.ndarray | float:
        return self.E + self.A / np.power(n, self.alpha) + self.B / np.power(d, self.beta)

    @property
    def a(self) -> float:
        """N_opt ∝ C^a under C = 6ND: a = β / (α + β)."""
        return self.beta / (self.alpha + self.beta)

    def optimal_params(self, flops: np.ndarray | float) -> np.ndarray | float:
        """N_opt(C) = G (C/6)^a with G = (αA / βB)^(1/(α+β)), minimizing L along C = 6ND."""
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))
        return g * np.power(np.asarray(flops) / 6, self.a)

    def as_dict(self) -> dict[str, float]:
        return {name: float(getattr(self, name)) for name in PARAMETERS}


def huber(residual: np.ndarray) -> np.ndarray:
    """Huber loss with δ = HUBER_DELTA, divided by δ² (the minimizer is the same; L-BFGS-B's tolerances then
    apply to values of order one)."""
    size = np.abs(residual)
    return np.where(size <= HUBER_DELTA, 0.5 * residual**2, HUBER_DELTA * (size - 0.5 * HUBER_DELTA)) / HUBER_DELTA**2


def huber_objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray):
    """Mean Huber loss of the log-domain residuals, and its gradient in θ = (a, b, e, α, β): the LSE's
    derivative in each of its terms is that term's softmax weight."""
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    top = terms.max(axis=0)
    weights = np.exp(terms - top)
    total = weights.sum(axis=0)
    residual = top + np.log(total) - log_l
    w = weights / total * np.clip(residual, -HUBER_DELTA, HUBER_DELTA) / HUBER_DELTA**2
    grad = np.array([w[0].sum(), w[1].sum(), w[2].sum(), -(w[0] * log_n).sum(), -(w[1] * log_d).sum()])
    return huber(residual).mean(), grad / len(log_n)


def grid_losses(log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every grid point θ and its objective, computed at once."""
    a, b, e, alpha, beta = np.meshgrid(GRID_AB, GRID_AB, GRID_E, GRID_EXPONENTS, GRID_EXPONENTS, indexing="ij")
    thetas = np.stack([x.ravel() for x in (a, b, e, alpha, beta)], axis=1)
    terms = np.stack(
        [
            thetas[:, :1] - thetas[:, 3:4] * log_n,
            thetas[:, 1:2] - thetas[:, 4:5] * log_d,
            np.broadcast_to(thetas[:, 2:3], (len(thetas), len(log_n))),
        ]
    )
    return thetas, huber(logsumexp(terms, axis=0) - log_l).mean(axis=1)


def fit_law(n: np.ndarray, d: np.ndarray, loss: np.ndarray, starts: np.ndarray | None = None) -> tuple[Law, float]:
    """The law of least Huber loss from the `starts` (θ rows; default: the STARTS best grid points), and its
    objective."""
    log_n, log_d, log_l = np.log(n), np.log(d), np.log(loss)
    if starts is None:
        thetas, values = grid_losses(log_n, log_d, log_l)
        starts = thetas[np.argsort(values)[:STARTS]]
    best_theta, best_value = None, math.inf
    for start in starts:
        found = minimize(
            huber_objective,
            start,
            args=(log_n, log_d, log_l),
            jac=True,
            method="L-BFGS-B",
            bounds=BOUNDS,
            options={"maxiter": MAX_ITERATIONS, "ftol": 1e-15, "gtol": 1e-10},
        )
        if found.fun < best_value:
            best_theta, best_value = found.x, float(found.fun)
    a, b, e, alpha, beta = best_theta
    return Law(math.exp(e), math.exp(a), math.exp(b), float(alpha), float(beta)), best_value


def theta_of(law: Law) -> np.ndarray:
    return np.array([math.log(law.A), math.log(law.B), math.log(law.E), law.alpha, law.beta])


@dataclass
class Approach3:
    law: Law
    objective: float
    boots: list[Law]  # the bootstrap refits
    seed: int

    def interval(self, values: np.ndarray) -> tuple[float, float]:
        tail = (1 - CONFIDENCE) / 2 * 100
        low, high = np.percentile(values, [tail, 100 - tail])
        return float(low), float(high)

    def intervals(self) -> dict[str, tuple[float, float]]:
        out = {name: self.interval(np.array([getattr(b, name) for b in self.boots])) for name in PARAMETERS}
        out["a"] = self.interval(np.array([b.a for b in self.boots]))
        return out

    def predict(self, n: float, d: float) -> tuple[float, tuple[float, float]]:
        """The fitted law's loss at (N, D) and its bootstrap interval."""
        return float(self.law.loss(n, d)), self.interval(np.array([b.loss(n, d) for b in self.boots]))

    def as_dict(self) -> dict:
        ci = self.intervals()
        return {
            "law": self.law.as_dict(),
            "a": self.law.a,
            "objective": self.objective,
            "intervals": {k: list(v) for k, v in ci.items()},
            "confidence": CONFIDENCE,
            "bootstrap": {"resamples": len(self.boots), "seed": self.seed},
        }


def approach3(n, d, loss, bootstrap: int = 200, seed: int = 0) -> Approach3:
    """The law and `bootstrap` refits on runs resampled with replacement (numpy Generator seeded by `seed`).
    A refit starts from the law itself: a resample's optimum lies near it, and starting every refit from the
    grid again would cost ~10× as much for the same answer."""
    n, d, loss = (np.asarray(x, dtype=np.float64) for x in (n, d, loss))
    law, objective = fit_law(n, d, loss)
    rng = np.random.default_rng(seed)
    start = theta_of(law)[None]
    boots = []
    for _ in range(bootstrap):
        pick = rng.integers(0, len(n), len(n))
        boots.append(fit_law(n[pick], d[pick], loss[pick], start)[0])
    return Approach3(law, objective, boots, seed)


@dataclass
class BudgetFit:
    """One budget's isoFLOP parabola L = c₀ + c₁ log N + c₂ (log N)²."""

    flops: float  # the geometric mean of its runs' FLOPs
    runs: list[int]  # indices into the fitted arrays
    coefficients: list[float] = field(default_factory=list)  # c₀, c₁, c₂
    params_opt: float | None = None
    tokens_opt: float | None = None
    loss_opt: float | None = None
    inside: bool = False  # the vertex lies within the sizes trained
    skipped: str | None = None  # why this budget gives no optimum

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Approach2:
    budgets: list[BudgetFit]
    a: float | None = None  # N_opt ∝ C^a
    b: float | None = None  # D_opt ∝ C^b
    skipped: str | None = None

    def as_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "skipped": self.skipped, "budgets": [b.as_dict() for b in self.budgets]}


def group_budgets(flops: np.ndarray) -> list[list[int]]:
    """Indices of runs per budget: sorted by FLOPs, a run more than GROUP_RATIO above its group's first
    starts the next group."""
    order = np.argsort(flops)
    groups: list[list[int]] = []
    for i in order:
        if groups and flops[i] <= GROUP_RATIO * flops[groups[-1][0]]:
            groups[-1].append(int(i))
        else:
            groups.append([int(i)])
    return groups


def approach2(n, d, flops, loss) -> Approach2:
    """Each budget's parabola vertex, then log N_opt and log D_opt linear in log C over the budgets that have
    one (at least two)."""
    n, d, flops, loss = (np.asarray(x, dtype=np.float64) for x in (n, d, flops, loss))
    fits = [budget_fit(group, n, d, flops, loss) for group in group_budgets(flops)]
    usable = [f for f in fits if f.params_opt is not None]
    if len(usable) < 2:
        return Approach2(
            fits,
            skipped=f"needs 2 budgets with {MIN_SIZES}+ sizes and a convex loss profile; {len(usable)} of "
            f"{len(fits)} have them",
        )
    log_c = np.log([f.flops for f in usable])
    a = np.polyfit(log_c, np.log([f.params_opt for f in usable]), 1)[0]
    b = np.polyfit(log_c, np.log([f.tokens_opt for f in usable]), 1)[0]
    return Approach2(fits, float(a), float(b))


def budget_fit(group: list[int], n, d, flops, loss) -> BudgetFit:
    fit = BudgetFit(float(np.exp(np.log(flops[group]).mean())), group)
    log_n = np.log(n[group])
    if len(set(n[group])) < MIN_SIZES:
        fit.skipped = f"{len(set(n[group]))} distinct sizes (a parabola needs {MIN_SIZES})"
        return fit
    c2, c1, c0 = np.polyfit(log_n, loss[group], 2)
    fit.coefficients = [float(c0), float(c1), float(c2)]
    if c2 <= 0:
        fit.skipped = "the losses are not convex in log N (no minimum)"
        return fit
    vertex = -c1 / (2 * c2)
    slope, intercept = np.polyfit(log_n, np.log(d[group]), 1)  # the budget's tokens as a function of size
    fit.params_opt = float(np.exp(vertex))
    fit.tokens_opt = float(np.exp(intercept + slope * vertex))
    fit.loss_opt = float(c0 + c1 * vertex + c2 * vertex**2)
    fit.inside = bool(log_n.min() <= vertex <= log_n.max())
    return fit


def check_enough(count: int) -> None:
    if count < MIN_RUNS:
        raise UserError(
            f"a scaling fit needs at least {MIN_RUNS} finished runs (L(N, D) has {len(PARAMETERS)} parameters); "
            f"got {count}",
            "add runs (e.g. more sizes per budget), or wait for the unfinished ones",
        )
