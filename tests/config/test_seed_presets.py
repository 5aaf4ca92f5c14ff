"""Presets written in the seed framework's layout (its schema, /work/shared/seeds/000) load unchanged and
validate for the world size each declares: tests/seed_presets/*.toml, dense 7B–70B with tp/pp/fsdp/hsdp mixes,
MoE with tp and ep, fp8, muon, a short benchmark that keeps its production warmup. Config and memory
estimate only: nothing is allocated, no process group starts.

A preset declares its layout in its header, `# validate: forge validate-config PATH --world-size N` (no
such line: world size 1), the convention presets/ follows too."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from engine.config import load_job_config
from engine.data.batch_plan import tokens_per_step
from engine.errors import ConfigError
from engine.parallel.memory import estimate_memory
from engine.plan import check_config, config_warnings

SEED_PRESETS = Path(__file__).parents[1] / "seed_presets"
PRESETS = sorted(SEED_PRESETS.glob("*.toml"))
# The sections of the seed schema: a preset of that framework uses no other.
SEED_SECTIONS = {"model", "train", "optimizer", "scheduler", "data", "eval", "distributed", "checkpoint", "metrics"}
GIB = 2**30


def declared_world_size(path: Path) -> int:
    """The --world-size of the preset's `# validate:` header line (1 without one)."""
    lines = [line for line in path.read_text().splitlines() if line.startswith("# validate:")]
    assert len(lines) <= 1, f"{path.name}: more than one validate line"
    if not lines:
        return 1
    match = re.fullmatch(rf"# validate: forge validate-config \S*{re.escape(path.name)} --world-size (\d+)", lines[0])
    assert match, f"{path.name}: malformed validate line {lines[0]!r}"
    return int(match.group(1))


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_seed_preset_validates_for_its_world_size_and_fits_80_gib(path):
    assert set(tomllib.loads(path.read_text())) <= SEED_SECTIONS, "a seed-layout preset uses the seed's sections"
    world = declared_world_size(path)
    cfg = check_config(load_job_config(path), world)
    stages = estimate_memory(cfg, world)
    assert len(stages) == cfg.distributed.pp
    assert all(0 < stage.total < 80 * GIB for stage in stages), [stage.total / GIB for stage in stages]


def test_the_gallery_covers_the_seed_layouts():
    """Dense 7B to 70B with tp, pp, FSDP and HSDP, MoE with tp alone and with ep, fp8, muon."""
    configs = {path.stem: load_job_config(path) for path in PRESETS}
    dense = {name: c for name, c in configs.items() if not c.model.is_moe}
    moe = {name: c for name, c in configs.items() if c.model.is_moe}
    assert {c.model.dim for c in dense.values()} >= {4096, 5120, 6656, 8192}  # 7/8B, 13B, 30B, 70B
    assert any(c.distributed.tp > 1 and c.distributed.pp > 1 for c in dense.values())
    assert any(c.distributed.dp_replicate > 1 and c.distributed.tp > 1 for c in dense.values())
    assert any(c.distributed.tp > 1 and c.distributed.ep == 1 for c in moe.values())
    assert sum(c.distributed.tp > 1 and c.distributed.ep > 1 for c in moe.values()) >= 2
    assert any(c.train.mixed_precision == "fp8" for c in configs.values())
    assert any(c.optimizer.name == "muon" for c in configs.values())
    assert configs["llama2_7b_fsdp"].checkpoint.export_dtype == "bfloat16"  # the seed's own export and W&B keys
    assert configs["llama2_7b_fsdp"].metrics.wandb_run_id == "llama2-7b-fsdp"


def test_seed_conventions_validate_with_a_warning_that_says_what_they_mean():
    warnings = {
        path.stem: {w.path for w in config_warnings(load_job_config(path), declared_world_size(path))}
        for path in PRESETS
    }
    assert warnings["llama2_7b_tp2_benchmark"] == {"scheduler.warmup_steps"}  # warmup 50, 20 steps
    assert warnings["moe_16x1b_tp4"] == {"model.moe_capacity_factor"}  # 0 = dropless
    assert warnings["moe_8x7b_tp4_ep2_seed_dp"] == {"distributed.dp_shard"}  # ep counted in the world size
    assert warnings["llama3_70b_tp8_pp4"] == set()
    # dp_shard 4 × tp 4 × ep 2 on 32 ranks: FSDP over 8 ranks, as dp_shard = -1 would give.
    seed_dp = load_job_config(SEED_PRESETS / "moe_8x7b_tp4_ep2_seed_dp.toml")
    assert seed_dp.distributed.resolved_dp_shard(32) == 8
    assert tokens_per_step(seed_dp, 32) == 8 * 4 * 4096  # 8 data-parallel ranks × 4 micro-batches × 4096


def test_the_seed_dp_shard_convention_needs_the_seeds_product():
    """The seed reading applies only where Forge's own does not fill the world: dp_shard 8 × tp 4 with ep 2
    on 32 ranks stays Forge's (experts over 2 of the 8), and a product that is neither is refused."""
    forge_way = load_job_config(SEED_PRESETS / "moe_8x7b_tp4_ep2_seed_dp.toml", ["--distributed.dp_shard=8"])
    assert check_config(forge_way, 32).distributed.resolved_dp_shard(32) == 8 and config_warnings(forge_way, 32) == []
    with pytest.raises(ConfigError, match="does not multiply to the world size 48"):
        check_config(forge_way, 48)
