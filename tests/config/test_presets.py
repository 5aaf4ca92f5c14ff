"""Every preset validates for the layout its header declares, as a user types the command, without building
the model; the big presets have the published models' parameter counts; docs/presets.md matches them."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from engine.config.loader import load_job_config
from engine.model.estimate import param_counts
from engine.parallel.memory import estimate_memory
from engine.plan import check_config
from engine.plan.presets_table import PRESETS, declared, main
from tests.conftest import REPO
from tests.helpers.cli import forge

ALL = sorted(PRESETS.glob("*.toml"))
H100_GIB = 80
HEADROOM = 0.85  # the CUDA context, fragmentation and NCCL buffers are not in the estimate


def child_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.mark.parametrize("preset", ALL, ids=[p.name for p in ALL])
def test_preset_validates_for_its_declared_layout(preset: Path):
    """The `# validate:` line run exactly as written (forge → python -m forgecli.app), from the repository
    root: exit 0 and the confirmation for that world size; a 70B answers in well under a few CPU seconds."""
    decl = declared(preset)
    assert decl.argv[:3] == ["forge", "validate-config", f"presets/{preset.name}"]
    before = child_cpu_seconds()
    result = forge(*decl.argv[1:], cwd=REPO)
    cpu = child_cpu_seconds() - before
    assert result.returncode == 0, result.stdout + result.stderr
    suffix = f" for world size {decl.world_size}" if decl.world_size > 1 else ""
    assert f"config is valid{suffix}\n" in result.stdout
    assert cpu < 10, f"validate-config took {cpu:.1f} CPU seconds"


def test_the_big_presets_declare_real_layouts_that_fit_an_h100():
    """Every preset meant for several GPUs fits 80 GB with headroom by the estimate, and the largest ones are
    really spread out (nothing can declare world size 1 and pass by not saying what it needs)."""
    worlds = {}
    for preset in ALL:
        decl = declared(preset)
        cfg = check_config(load_job_config(preset, decl.overrides), decl.world_size)
        worlds[preset.stem] = decl.world_size
        if decl.world_size > 1:
            peak = max(stage.total for stage in estimate_memory(cfg, decl.world_size))
            assert peak <= HEADROOM * H100_GIB * 2**30, (preset.name, peak / 2**30)
    assert len(worlds) >= 13
    assert worlds["70b"] == 256 and worlds["34b"] >= 32 and worlds["mixtral_8x7b"] >= 16
    assert worlds["debug"] == 1


PUBLISHED = {  # the model cards' exact parameter counts (Hugging Face num_parameters())
    "1b": 1_235_814_400,  # Llama 3.2 1B
    "3b": 3_212_749_824,  # Llama 3.2 3B
    "7b": 6_738_415_616,  # Llama 2 7B
    "8b": 8_030_261_248,  # Llama 3.1 8B
    "13b": 13_015_864_320,  # Llama 2 13B
    "34b": 33_743_970_304,  # Code Llama 34B
    "70b": 70_553_706_496,  # Llama 3 70B
    "mixtral_8x7b": 46_702_792_704,  # Mixtral 8x7B
}


def test_presets_have_the_parameter_counts_of_the_models_they_copy():
    """The presets copied from a released model have its exact size (so the shape is the published one:
    a wrong FFN width, KV-head count, vocabulary or tying moves the count); the GPT-3-shaped ones, whose
    vocabulary and FFN differ from GPT-3's, are near their nominal size. engine.model.estimate's counts are
    held to the built model's by tests/model/test_transformer.py and tests/model/test_moe.py."""
    counts = {p.stem: param_counts(load_job_config(p).model)["total"] for p in ALL}
    assert {name: counts[name] for name in PUBLISHED} == PUBLISHED
    assert 0.12e9 < counts["125m"] < 0.14e9 and 0.35e9 < counts["350m"] < 0.4e9
    assert 0.74e9 < counts["760m"] < 0.8e9 and 1.3e9 < counts["1.3b"] < 1.4e9


def test_a_malformed_validate_line_is_refused(tmp_path: Path):
    preset = tmp_path / "x.toml"
    preset.write_text("# validate: forge validate-config presets/other.toml --world-size 8\n[model]\ndim = 64\n")
    with pytest.raises(ValueError, match=r"presets/x\.toml"):
        declared(preset)
    preset.write_text("# validate: forge validate-config presets/x.toml --world-size 8 --tp 2\n")
    with pytest.raises(ValueError, match="--tp"):
        declared(preset)
    preset.write_text("# validate: forge validate-config presets/x.toml --world-size=16 --distributed.tp=2\n")
    assert (declared(preset).world_size, declared(preset).overrides) == (16, ["--distributed.tp=2"])
    preset.write_text("[model]\ndim = 64\n")
    assert declared(preset).world_size == 1


def test_presets_doc_is_up_to_date(capsys: pytest.CaptureFixture[str]):
    assert main(["--check"]) == 0, capsys.readouterr().err
    assert "| [`70b.toml`](../presets/70b.toml) | 70.6 G |" in (REPO / "docs" / "presets.md").read_text()


def test_presets_doc_check_fails_when_stale(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from engine.plan import presets_table

    stale = tmp_path / "presets.md"
    stale.write_text((REPO / "docs" / "presets.md").read_text().replace("70.6 G", "70 G"))
    monkeypatch.setattr(presets_table, "DOC", stale)
    assert main(["--check"]) == 1
    assert main([]) == 0 and main(["--check"]) == 0
