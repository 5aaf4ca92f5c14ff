"""Shared test set-up: a per-session cache for the embedded corpus, and the `parity` fixture and marker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.parity import Parity

REPO = Path(__file__).resolve().parents[1]
# Tests read local models and datasets only; never wait on the network. Set at import, before test modules
# import transformers or datasets (which read it once).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# pytest-xdist's workers start with COLUMNS=80 in their environment, and a Rich console made while COLUMNS is
# set keeps that width for good: the CLI's consoles (forgecli/ui.py, made at import) would then ignore the
# COLUMNS that in-process CLI tests pass, and wrap long paths in their panels differently under xdist than in
# one process. Without it they are 80 wide off a terminal all the same, and read COLUMNS when they measure.
os.environ.pop("COLUMNS", None)


@pytest.fixture(scope="session", autouse=True)
def forge_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One corpus cache shared by the xdist workers of a session (its build is atomic, so sharing is safe)."""
    root = tmp_path_factory.getbasetemp()
    shared = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "forge-cache"
    shared.mkdir(exist_ok=True)
    os.environ["FORGE_CACHE_DIR"] = str(shared)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("HF_DATASETS_CACHE", str(shared / "hf-datasets"))
    return shared


@pytest.fixture
def parity(request: pytest.FixtureRequest):
    """The test's parity comparisons (tests/helpers/parity.py); a parity test that compared nothing fails."""
    checks = Parity(request.node.nodeid)
    yield checks
    report = getattr(request.node, "call_report", None)
    if report is not None and report.passed:
        assert checks.records, f"{request.node.nodeid} asked for `parity` but compared nothing"


def pytest_itemcollected(item: pytest.Item) -> None:
    """A test that asks for the `parity` fixture is a parity test: marked so that `-m parity` selects it."""
    if "parity" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.parity)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Keeps the call phase's report on the item, for the `parity` fixture's teardown."""
    report = yield
    if report.when == "call":
        item.call_report = report
    return report
