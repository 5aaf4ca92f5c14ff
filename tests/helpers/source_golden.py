"""What every preset's data resolves to: its training sources (kind, location, the field naming it), its
evaluation source, and, where the data exists on this machine, `TrainData.identity()` (what a checkpoint's
train state records, so a run resumes only on the same data). Recorded from main before the config learned a
second spelling of each source field (issue 32); tests/data/test_source_kinds.py checks that every preset still
resolves to exactly this.

Re-record (only after a change meant to alter what a preset trains on; review the diff):

    PYTHONPATH=$PWD python -m tests.helpers.source_golden
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "preset_sources.json"
PRESETS = sorted([*REPO.glob("presets/*.toml"), *REPO.glob("tests/seed_presets/*.toml")])


def resolved(path: Path) -> dict:
    """One preset's sources and, where every training source exists here, its data identity."""
    from engine.config import load_job_config
    from engine.data.loader import open_train_data
    from engine.data.source_kinds import section_source, train_sources

    cfg = load_job_config(path)
    sources = train_sources(cfg)
    evaluated = section_source(cfg, "eval")
    here = all(s.kind == "embedded" or (s.kind == "shards" and Path(s.location).is_dir()) for s in sources)
    return {
        "sources": [[s.kind, s.location, s.field] for s in sources],
        "eval": [evaluated.kind, evaluated.location, evaluated.field] if evaluated else None,
        "identity": open_train_data(cfg).identity() if here else None,
    }


def snapshot() -> dict[str, dict]:
    return {str(p.relative_to(REPO)): resolved(p) for p in PRESETS}


if __name__ == "__main__":
    os.environ.setdefault("FORGE_CACHE_DIR", tempfile.mkdtemp(prefix="forge-cache-"))
    GOLDEN.write_text(json.dumps(snapshot(), indent=1) + "\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)
