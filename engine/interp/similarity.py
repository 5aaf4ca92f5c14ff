"""Representation similarity between layers and models: linear CKA, SVCCA, RSA.

Every CKA and SVCCA figure is a function of a few sums over the rows — Σz, ZᵀZ over all layers side by
side, and the squared row norms — so `GramStats` accumulates them batch by batch and the data never has to
fit in memory (memory is (Σ features)², independent of the number of rows). Rows are shifted by the first
batch's mean before they are summed: every measure here is invariant to a shift, and it keeps the float64
sums from cancelling when a residual stream has a large mean.

- Linear CKA (Kornblith et al. 2019): HSIC(K, L) / √(HSIC(K, K)·HSIC(L, L)) with K = XXᵀ, L = YYᵀ, using
  the biased HSIC (centred Gram matrices) or the unbiased estimator of Song et al. (2012), which removes the
  bias the biased one has when features outnumber rows.
- SVCCA (Raghu et al. 2017): keep the principal directions that explain `keep` of each representation's
  variance, then the mean canonical correlation between the two reduced representations.
- RSA (Kriegeskorte et al. 2008): the Spearman correlation of the two representational dissimilarity
  matrices (1 − Pearson correlation between rows). Its matrices are rows × rows, so it runs on at most
  `rsa_rows` rows spread evenly over the data, read straight from the memory map.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.errors import UserError

METRICS = ("cka", "cka_unbiased", "svcca", "rsa")
DEFAULT_KEEP = 0.99
DEFAULT_RSA_ROWS = 2000


@dataclass
class GramStats:
    """Sufficient statistics of several representations over the same rows, accumulated batch by batch."""

    widths: list[int]
    n: int = 0
    shift: np.ndarray | None = None
    total: np.ndarray = field(init=False)  # Σ z over rows, z the concatenated (shifted) features
    gram: np.ndarray = field(init=False)  # Σ z zᵀ
    norms_outer: np.ndarray = field(init=False)  # Σ a aᵀ, a_p = |z_p|² per representation p
    z_norms: np.ndarray = field(init=False)  # Σ z aᵀ

    def __post_init__(self) -> None:
        width, count = sum(self.widths), len(self.widths)
        self.total = np.zeros(width)
        self.gram = np.zeros((width, width))
        self.norms_outer = np.zeros((count, count))
        self.z_norms = np.zeros((width, count))
        self.bounds = np.cumsum([0, *self.widths])

    def add(self, blocks: Sequence[np.ndarray]) -> None:
        """One batch: the same rows of each representation, each (rows, features)."""
        z = np.concatenate([np.asarray(b, dtype=np.float64).reshape(len(b), -1) for b in blocks], axis=1)
        if self.shift is None:
            self.shift = z.mean(axis=0)
        z = z - self.shift
        norms = np.stack([(z[:, a:b] ** 2).sum(axis=1) for a, b in self.block_bounds()], axis=1)
        self.n += len(z)
        self.total += z.sum(axis=0)
        self.gram += z.T @ z
        self.norms_outer += norms.T @ norms
        self.z_norms += z.T @ norms

    def block_bounds(self) -> list[tuple[int, int]]:
        return [(int(self.bounds[p]), int(self.bounds[p + 1])) for p in range(len(self.widths))]

    def part(self, p: int, q: int) -> np.ndarray:
        (a, b), (c, d) = self.block_bounds()[p], self.block_bounds()[q]
        return self.gram[a:b, c:d]

    def centered(self, p: int, q: int) -> np.ndarray:
        """Σ (x − x̄)(y − ȳ)ᵀ between representations p and q."""
        (a, b), (c, d) = self.block_bounds()[p], self.block_bounds()[q]
        return self.part(p, q) - np.outer(self.total[a:b], self.total[c:d]) / self.n

    def hsic_biased(self, p: int, q: int) -> float:
        """tr(K H L H) up to the 1/(n−1)² factor that cancels in CKA: ‖X̃ᵀỸ‖²_F with centred X̃, Ỹ."""
        return float((self.centered(p, q) ** 2).sum())

    def hsic_unbiased(self, p: int, q: int) -> float:
        """Song et al.'s unbiased HSIC of K = XXᵀ, L = YYᵀ, with the diagonals zeroed (K̃, L̃):
        [tr(K̃L̃) + 1ᵀK̃1·1ᵀL̃1/((n−1)(n−2)) − 2·1ᵀK̃L̃1/(n−2)] / (n(n−3)), each term from the sums."""
        n = self.n
        if n < 4:
            raise UserError(f"unbiased CKA needs at least 4 rows (got {n})", "extract more tokens")
        (a, b), (c, d) = self.block_bounds()[p], self.block_bounds()[q]
        sx, sy = self.total[a:b], self.total[c:d]
        diag = self.norms_outer[p, q]  # Σ K_ii L_ii
        trace = float((self.part(p, q) ** 2).sum()) - diag
        sum_k = sx @ sx - np.trace(self.part(p, p))
        sum_l = sy @ sy - np.trace(self.part(q, q))
        # 1ᵀK̃L̃1 = Σ_i (x_i·s_x − |x_i|²)(y_i·s_y − |y_i|²)
        cross = sx @ self.part(p, q) @ sy - sx @ self.z_norms[a:b, q] - sy @ self.z_norms[c:d, p] + diag
        return float((trace + sum_k * sum_l / ((n - 1) * (n - 2)) - 2 * cross / (n - 2)) / (n * (n - 3)))

    def cka(self, p: int, q: int, unbiased: bool = False) -> float:
        hsic = self.hsic_unbiased if unbiased else self.hsic_biased
        denominator = np.sqrt(abs(hsic(p, p) * hsic(q, q)))
        return float(hsic(p, q) / denominator) if denominator > 0 else float("nan")

    def svcca(self, p: int, q: int, keep: float = DEFAULT_KEEP) -> float:
        """Mean canonical correlation between the top principal subspaces (covariances from the sums)."""
        bx, by = principal(self.centered(p, p), keep), principal(self.centered(q, q), keep)
        (vx, ex), (vy, ey) = bx, by
        cross = vx.T @ self.centered(p, q) @ vy
        whitened = cross / np.sqrt(np.outer(ex, ey))
        correlations = np.clip(np.linalg.svd(whitened, compute_uv=False), 0.0, 1.0)
        return float(correlations[: min(len(ex), len(ey))].mean())


def principal(cov: np.ndarray, keep: float) -> tuple[np.ndarray, np.ndarray]:
    """Eigenvectors and eigenvalues of the fewest leading directions explaining `keep` of the variance
    (directions with numerically zero variance never count)."""
    values, vectors = np.linalg.eigh(cov)
    values, vectors = values[::-1], vectors[:, ::-1]
    positive = values > values[0] * 1e-10
    values, vectors = values[positive], vectors[:, positive]
    explained = np.cumsum(values) / values.sum()
    count = int(np.searchsorted(explained, keep - 1e-12) + 1)
    count = min(count, len(values))
    return vectors[:, :count], values[:count]


def check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise UserError(f"--metric {metric!r} is not one of {', '.join(METRICS)}", "e.g. --metric cka")


def pairwise(
    read: Callable[[int, int], list[np.ndarray]],
    rows: int,
    widths: Sequence[int],
    left: Sequence[int],
    right: Sequence[int],
    metric: str,
    batch_rows: int = 4096,
    keep: float = DEFAULT_KEEP,
    rsa_rows: int = DEFAULT_RSA_ROWS,
    progress: Callable[[int, int], None] | None = None,
) -> np.ndarray:
    """metric(left[i], right[j]) for every pair, over representations whose rows [a, b) `read(a, b)` gives (one
    array per representation, in `widths` order)."""
    check_metric(metric)
    if rows < 2:
        raise UserError(f"similarity needs at least 2 rows (got {rows})", "extract more tokens")
    if metric == "rsa":
        picked = np.unique(np.linspace(0, rows - 1, min(rows, rsa_rows)).round().astype(np.int64))
        blocks = read_rows(read, picked, len(widths), batch_rows)
        rdms = [rdm(block) for block in blocks]
        return np.array([[spearman(rdms[p], rdms[q]) for q in right] for p in left])
    stats = GramStats(list(widths))
    for start in range(0, rows, batch_rows):
        stats.add(read(start, min(rows, start + batch_rows)))
        if progress is not None:
            progress(min(rows, start + batch_rows), rows)

    def measure(p: int, q: int) -> float:
        if metric == "svcca":
            return stats.svcca(p, q, keep)
        return stats.cka(p, q, unbiased=metric == "cka_unbiased")

    return np.array([[measure(p, q) for q in right] for p in left])


def read_rows(
    read: Callable[[int, int], list[np.ndarray]], picked: np.ndarray, count: int, batch_rows: int
) -> list[np.ndarray]:
    """The picked rows (sorted) of every representation, read batch by batch in order."""
    parts: list[list[np.ndarray]] = [[] for _ in range(count)]
    for start in range(0, int(picked[-1]) + 1, batch_rows):
        inside = picked[(picked >= start) & (picked < start + batch_rows)] - start
        if len(inside) == 0:
            continue
        for p, block in enumerate(read(start, min(start + batch_rows, int(picked[-1]) + 1))):
            parts[p].append(np.asarray(block, dtype=np.float64).reshape(len(block), -1)[inside])
    return [np.concatenate(p) for p in parts]


def rdm(x: np.ndarray) -> np.ndarray:
    """The upper triangle of 1 − Pearson correlation between rows."""
    x = x - x.mean(axis=1, keepdims=True)
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-300)
    upper = np.triu_indices(len(x), k=1)
    return (1.0 - x @ x.T)[upper]


def ranks(values: np.ndarray) -> np.ndarray:
    """Ranks with ties averaged (what Spearman's correlation uses)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    new_group = np.r_[True, ordered[1:] != ordered[:-1]]
    starts = np.flatnonzero(new_group)
    ends = np.r_[starts[1:], len(values)]
    ranked = np.empty(len(values))
    ranked[order] = ((starts + ends - 1) / 2)[np.cumsum(new_group) - 1]
    return ranked


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = np.sqrt((ra**2).sum() * (rb**2).sum())
    return float((ra * rb).sum() / denominator) if denominator > 0 else float("nan")


def in_memory(xs: Sequence[np.ndarray], metric: str, **options: object) -> np.ndarray:
    """metric between every pair of in-memory representations (rows, features) over the same rows."""
    rows = len(xs[0])
    indices = list(range(len(xs)))
    return pairwise(
        lambda a, b: [x[a:b] for x in xs],
        rows,
        [int(np.prod(x.shape[1:])) for x in xs],
        indices,
        indices,
        metric,
        **options,
    )


def linear_cka(x: np.ndarray, y: np.ndarray, unbiased: bool = False) -> float:
    return float(in_memory([x, y], "cka_unbiased" if unbiased else "cka")[0, 1])


def svcca(x: np.ndarray, y: np.ndarray, keep: float = DEFAULT_KEEP) -> float:
    return float(in_memory([x, y], "svcca", keep=keep)[0, 1])


def rsa(x: np.ndarray, y: np.ndarray, rsa_rows: int = DEFAULT_RSA_ROWS) -> float:
    return float(in_memory([x, y], "rsa", rsa_rows=rsa_rows)[0, 1])


@dataclass(frozen=True)
class Comparison:
    metric: str
    rows: int
    left: list[str]  # layer names of the first output (rows of `values`)
    right: list[str]  # of the second (columns)
    values: np.ndarray


def compare(
    first: Path,
    second: Path | None,
    layers: Sequence[str] = (),
    metric: str = "cka",
    keep: float = DEFAULT_KEEP,
    rsa_rows: int = DEFAULT_RSA_ROWS,
    batch_rows: int = 4096,
    progress: Callable[[int, int], None] | None = None,
) -> Comparison:
    """Layer × layer similarity of two `forge extract` outputs over the same tokens (or of one with itself)."""
    from engine.interp.modules import matches
    from engine.interp.store import load_activations

    check_metric(metric)
    a = load_activations(first)
    b = a if second is None else load_activations(second)
    if len(a.tokens) != len(b.tokens) or not np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens)):
        raise UserError(
            f"{first} and {second} hold activations of different tokens ({len(a.tokens)} and {len(b.tokens)} rows)",
            "extract both with the same --data, --seq-len, --max-tokens and --positions",
        )

    def chosen(acts: object, where: Path) -> list[str]:
        names = [n for n in acts.layers if not layers or any(matches(n, p) for p in layers)]
        if not names:
            raise UserError(
                f"--layers {' '.join(layers)} matches no layer of {where}", f"it has {', '.join(acts.layers)}"
            )
        return names

    left, right = chosen(a, first), chosen(b, second or first)
    arrays = [a[n] for n in left] + ([] if second is None else [b[n] for n in right])
    widths = [int(np.prod(x.shape[1:])) for x in arrays]
    right_index = [left.index(n) for n in right] if second is None else list(range(len(left), len(arrays)))

    def read(start: int, end: int) -> list[np.ndarray]:
        return [as_float(x[start:end]) for x in arrays]

    values = pairwise(
        read, len(a.tokens), widths, list(range(len(left))), right_index, metric, batch_rows, keep, rsa_rows, progress
    )
    return Comparison(metric, len(a.tokens), left, right, values)


def as_float(block: object) -> np.ndarray:
    """Rows as float64 numpy (a bf16 layer comes back as a torch tensor)."""
    if hasattr(block, "float") and not isinstance(block, np.ndarray):
        return block.float().numpy().astype(np.float64)
    return np.asarray(block, dtype=np.float64)
