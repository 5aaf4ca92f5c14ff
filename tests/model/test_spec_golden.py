"""What `forge validate-config --json` computes of a model (parameters, FLOPs per token, memory per pipeline
rank, checkpoint bytes) for every preset and seed preset at several layouts, compared with golden files
recorded before model families became specs (issue 29). Any change to these numbers is a change to the
estimate, not a refactoring: it must show up here.

In process, as validate-config computes them (`job_summary`, `estimate_memory`, `checkpoint_bytes`), so the
whole file runs in about a second. `python tests/model/test_spec_golden.py` rewrites the golden files (only when the
estimate is meant to change)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from engine.plan import resolve

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "specs"
PRESETS = sorted((REPO / "presets").glob("*.toml")) + sorted((REPO / "tests" / "seed_presets").glob("*.toml"))

SINGLE = ["distributed.tp=1", "distributed.pp=1", "distributed.ep=1", "distributed.cp=1", "distributed.dp_replicate=1"]
SINGLE += ["distributed.dp_shard=-1"]
# Layout and setting variants tried on every preset; those its other settings make invalid are left out of
# the golden file (the file lists what was recorded).
VARIANTS: list[tuple[str, int | None, list[str]]] = [
    ("declared", None, []),
    ("declared_x2", -2, []),
    ("single", 1, SINGLE),
    ("dp4", 4, SINGLE),
    ("tp2_pp2", 8, [*SINGLE[:-1], "distributed.tp=2", "distributed.pp=2", "distributed.pp_schedule='1f1b'"]),
    ("pp2_interleaved", 2, [*SINGLE, "distributed.pp=2", "distributed.pp_schedule='interleaved_1f1b'"]),
    ("pp2_gpipe", 2, [*SINGLE, "distributed.pp=2", "distributed.pp_schedule='gpipe'"]),
    ("ep2", 4, [*SINGLE, "distributed.ep=2"]),
    ("cp2_ring", 2, [*SINGLE, "distributed.cp=2", "distributed.cp_method='ring'"]),
    ("lion", 1, [*SINGLE, "optimizer.name='lion'"]),
    ("muon", 2, [*SINGLE, "optimizer.name='muon'"]),
    ("schedule_free", 1, [*SINGLE, "optimizer.name='schedule_free_adamw'", "scheduler.name='constant'"]),
    ("selective_ckpt", None, ["train.activation_checkpointing='selective'"]),
    ("full_ckpt_fp32", 1, [*SINGLE, "train.activation_checkpointing='full'", "train.mixed_precision='fp32'"]),
    ("ema_packed", 1, [*SINGLE, "train.ema_decay=0.999", "data.pack_sequences=true"]),
    ("tied_qk_norm", 2, [*SINGLE, "model.tie_embeddings=true", "model.qk_norm=true"]),
    ("tied_pp2", 2, [*SINGLE, "model.tie_embeddings=true", "distributed.pp=2", "distributed.pp_schedule='1f1b'"]),
    ("chunked_ce_layernorm", 1, [*SINGLE, "train.loss_fn='chunked_cross_entropy'", "model.norm_type='layernorm'"]),
    ("lora", 1, [*SINGLE, "lora.enabled=true", "lora.target_modules=['layers.*.attention.w[qkvo]', 'output']"]),
    ("unpacked_experts", 1, [*SINGLE, "model.moe_packed_experts=false"]),
]


def declared_world_size(preset: Path) -> int:
    """The world size the preset's own `validate:` comment names, else 1."""
    found = re.search(r"--world-size (\d+)", preset.read_text())
    return int(found.group(1)) if found else 1


def estimate(preset: Path, overrides: list[str], world_size: int) -> dict:
    """What validate-config --json reports of the model and layout (torch-free, in process)."""
    from engine.config.loader import load_job_config
    from engine.parallel.memory import checkpoint_bytes
    from engine.plan.summary import job_summary

    job = resolve(load_job_config(preset, overrides), world_size)
    cfg, summary = job.config, job_summary(job)
    numbers = {
        "parameters": summary["parameters"],
        "flops_per_token": summary["flops_per_token"],
        "memory": [stage.as_dict() for stage in job.memory],
        "checkpoint_bytes": checkpoint_bytes(cfg),
    }
    return json.loads(json.dumps(numbers))  # as the JSON output holds them (tuples become lists)


def record(preset: Path) -> dict:
    """Every variant of VARIANTS that `preset` accepts, estimated (MoE-only variants only on MoE presets)."""
    from engine.config.loader import load_job_config
    from engine.errors import UserError

    declared = declared_world_size(preset)
    is_moe = load_job_config(preset).model.is_moe
    entries = {}
    for name, world_size, overrides in VARIANTS:
        if name in ("ep2", "unpacked_experts") and not is_moe:
            continue
        size = declared if world_size is None else (declared * -world_size if world_size < 0 else world_size)
        try:
            entries[name] = {"world_size": size, "overrides": overrides, **estimate(preset, overrides, size)}
        except UserError:
            continue
    return entries


def golden_file(preset: Path) -> Path:
    return GOLDEN / f"{preset.parent.name}__{preset.stem}.json"


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_validate_config_numbers_equal_the_golden_ones(preset):
    golden = json.loads(golden_file(preset).read_text())
    assert len(golden) >= 3, f"{preset}: too few layouts recorded to pin its estimate"
    for name, entry in golden.items():
        now = estimate(preset, entry["overrides"], entry["world_size"])
        recorded = {key: entry[key] for key in now}
        assert now == recorded, f"{preset.name} [{name}] changed"


def test_every_preset_has_a_golden_file():
    assert {golden_file(p).name for p in PRESETS} == {f.name for f in GOLDEN.glob("*.json")}


def test_the_golden_files_cover_every_optimizer_and_layout_kind():
    """The recorded variants include each optimizer, pp, tp, ep, cp and LoRA somewhere (so the comparison
    covers every optimizer's state size and every layout's terms)."""
    seen = set()
    for file in GOLDEN.glob("*.json"):
        seen |= set(json.loads(file.read_text()))
    assert {"lion", "muon", "schedule_free", "tp2_pp2", "pp2_interleaved", "ep2", "cp2_ring", "lora"} <= seen


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for path in PRESETS:
        entries = record(path)
        golden_file(path).write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
        print(f"{path.name}: {', '.join(entries)}")
