"""Shared test set-up: a per-session cache for the embedded corpus, and a CLI runner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Tests read local models and datasets only; never wait on the network. Set at import, before test modules
# import transformers or datasets (which read it once).
os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
