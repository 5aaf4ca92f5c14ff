"""Representation similarity (engine/interp/similarity.py) against closed forms, invariances and a direct NumPy
computation on the full rows × rows Gram matrices, and streaming (batch by batch) against in-memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.errors import UserError
from engine.interp.similarity import in_memory, linear_cka, rsa, svcca
from tests.helpers.parity import FP64_TOL


def data(seed: int = 0, n: int = 300, dx: int = 12, dy: int = 9) -> tuple[np.ndarray, np.ndarray]:
    """Two related representations with a large mean (as a residual stream has)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dx)) * rng.uniform(0.2, 3, size=dx) + 50
    y = np.tanh(x[:, :dy] @ rng.normal(size=(dy, dy)) / 20) + 0.3 * rng.normal(size=(n, dy)) - 7
    return x, y


def direct_cka(x: np.ndarray, y: np.ndarray, unbiased: bool) -> float:
    """From the n × n Gram matrices, as the papers write it."""

    def hsic(k: np.ndarray, l_: np.ndarray) -> float:
        n = len(k)
        if not unbiased:
            h = np.eye(n) - 1 / n
            return float(np.sum((h @ k @ h) * (h @ l_ @ h)))
        k, l_ = k - np.diag(np.diag(k)), l_ - np.diag(np.diag(l_))
        total = np.trace(k @ l_) + k.sum() * l_.sum() / ((n - 1) * (n - 2)) - 2 * (k @ l_).sum() / (n - 2)
        return float(total / (n * (n - 3)))

    k, l_ = x @ x.T, y @ y.T
    return hsic(k, l_) / np.sqrt(hsic(k, k) * hsic(l_, l_))


def direct_svcca(x: np.ndarray, y: np.ndarray, keep: float) -> float:
    """Raghu et al.: SVD of the centred data, top directions to `keep` of the variance, CCA by QR."""

    def reduced(a: np.ndarray) -> np.ndarray:
        a = a - a.mean(axis=0)
        u, s, _ = np.linalg.svd(a, full_matrices=False)
        explained = np.cumsum(s**2) / (s**2).sum()
        k = int(np.searchsorted(explained, keep - 1e-12) + 1)
        return u[:, :k] * s[:k]

    qx, _ = np.linalg.qr(reduced(x))
    qy, _ = np.linalg.qr(reduced(y))
    rho = np.linalg.svd(qx.T @ qy, compute_uv=False)
    return float(rho[: min(qx.shape[1], qy.shape[1])].mean())


def direct_rsa(x: np.ndarray, y: np.ndarray) -> float:
    upper = np.triu_indices(len(x), k=1)
    a, b = (1 - np.corrcoef(x))[upper], (1 - np.corrcoef(y))[upper]
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))  # no ties in random data
    return float(np.corrcoef(ra, rb)[0, 1])


@pytest.mark.parametrize("unbiased", [False, True])
def test_cka_agrees_with_numpy_on_the_full_gram_matrices(unbiased, parity):
    """float64 throughout; values in [0, 1]: two routes to the same number within parity.FP64_TOL. The Gram
    matrices are formed from the centred data (CKA is shift-invariant, test_invariances): from the raw data
    (mean 50) the unbiased formula cancels terms (mean²/variance)² ≈ 10^6 times larger than its result, which
    would cost the reference, not our streaming code, six digits; ours still gets the raw data."""
    x, y = data()
    reference = direct_cka(x - x.mean(0), y - y.mean(0), unbiased)
    parity.within("CKA against the Gram matrices", abs(linear_cka(x, y, unbiased=unbiased) - reference), FP64_TOL)
    parity.within("CKA of x with itself", abs(linear_cka(x, x, unbiased=unbiased) - 1), FP64_TOL)


def test_svcca_and_rsa_agree_with_numpy(parity):
    """float64; values in [0, 1] (parity.FP64_TOL)."""
    x, y = data(1)
    for keep in (0.99, 0.9, 1.0):
        parity.within(f"SVCCA keep {keep}", abs(svcca(x, y, keep=keep) - direct_svcca(x, y, keep)), FP64_TOL)
    parity.within("RSA", abs(rsa(x[:120], y[:120]) - direct_rsa(x[:120], y[:120])), FP64_TOL)
    parity.within("SVCCA of x with itself", abs(svcca(x, x, keep=1.0) - 1), FP64_TOL)
    parity.within("RSA of x with itself", abs(rsa(x[:50], x[:50]) - 1), FP64_TOL)


def test_invariances(parity):
    """float64; the invariant measures equal on the moved data within parity.FP64_TOL."""
    x, y = data(2)
    rng = np.random.default_rng(3)
    rotation, _ = np.linalg.qr(rng.normal(size=(x.shape[1], x.shape[1])))
    invertible = rng.normal(size=(x.shape[1], x.shape[1])) + 3 * np.eye(x.shape[1])
    moved = 4.5 * x @ rotation + 2.0  # orthogonal transform, isotropic scale, shift
    for unbiased in (False, True):
        parity.within(
            f"CKA (unbiased={unbiased})", abs(linear_cka(moved, y, unbiased) - linear_cka(x, y, unbiased)), FP64_TOL
        )
    parity.within("SVCCA", abs(svcca(moved, y) - svcca(x, y)), FP64_TOL)
    parity.within("SVCCA, invertible map", abs(svcca(x @ invertible, y, keep=1.0) - svcca(x, y, keep=1.0)), FP64_TOL)
    # and CKA is not invariant to every invertible map (that is what tells it apart from CCA)
    stretch = np.diag(np.logspace(-2, 2, x.shape[1]))
    assert abs(linear_cka(x @ stretch, y) - linear_cka(x, y)) > 1e-2


def test_streaming_equals_in_memory(parity):
    x, y = data(4, n=517)
    for metric in ("cka", "cka_unbiased", "svcca"):
        whole = in_memory([x, y], metric, batch_rows=10_000)
        streamed = in_memory([x, y], metric, batch_rows=37)
        assert whole.shape == streamed.shape == (2, 2)
        parity.close(torch.from_numpy(streamed), torch.from_numpy(whole), atol=FP64_TOL, what=f"{metric} streamed")
        parity.within(f"{metric} of x with itself", abs(whole[0, 0] - 1), FP64_TOL)


def test_too_few_rows_and_unknown_metric():
    x, y = data(n=3)
    with pytest.raises(UserError, match="at least 4 rows"):
        linear_cka(x, y, unbiased=True)
    with pytest.raises(UserError, match="--metric"):
        in_memory([x, y], "cosine")
