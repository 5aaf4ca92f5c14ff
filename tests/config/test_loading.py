"""Loading presets, overrides, and validation errors that name the field and the fix."""

from __future__ import annotations

import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import Field, create_model

from engine.config import JobConfig, dump_toml, load_job_config, reference
from engine.config.loader import parse_literal
from engine.config.model import ModelConfig
from engine.errors import ConfigError
from engine.plan import check_config, config_warnings

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "preset.toml"
    path.write_text(text)
    return path


def paths(err: ConfigError) -> list[str]:
    return [i.path for i in err.issues]


def test_debug_preset_loads_and_validates():
    cfg = check_config(load_job_config(REPO / "presets" / "debug.toml"), 1)
    assert cfg.model.vocab_size == 4096 and cfg.data.dataset_path is None


def test_seed_schema_preset_loads_unchanged(tmp_path):
    """Field names follow the seed framework's schema, so its small presets load as they are."""
    text = """
[model]
dim = 256
n_layers = 4
n_heads = 4
n_kv_heads = 4
vocab_size = 32000
max_seq_len = 512
[train]
batch_size = 4
seq_len = 512
max_steps = 100
grad_accum_steps = 1
grad_clip_norm = 1.0
seed = 42
compile_model = false
activation_checkpointing = "none"
[optimizer]
name = "adamw"
lr = 3e-4
weight_decay = 0.1
betas = [0.9, 0.95]
eps = 1e-8
fused = true
[scheduler]
name = "cosine"
warmup_steps = 10
min_lr_ratio = 0.1
[data]
num_workers = 2
pin_memory = true
prefetch_factor = 2
[distributed]
dp_shard = -1
dp_replicate = 1
tp = 1
pp = 1
[checkpoint]
dir = "checkpoints/debug"
interval = 50
keep_last_n = 2
[metrics]
log_interval = 5
enable_wandb = false
enable_tensorboard = false
[profiling]
enable = false
"""
    cfg = check_config(load_job_config(write(tmp_path, text)), 1)
    assert cfg.optimizer.betas == (0.9, 0.95) and cfg.checkpoint.keep_last_n == 2


def test_overrides_are_toml_literals_and_win_over_preset(tmp_path):
    preset = write(tmp_path, "[optimizer]\nlr = 1e-3\n")
    cfg = load_job_config(
        preset,
        [
            "--optimizer.lr=5e-4",
            "--optimizer.betas=[0.8,0.99]",
            "--train.compile_model=false",
            "--data.dataset_path=/data/shards",
            '--metrics.wandb_run_name="a b"',
        ],
    )
    assert cfg.optimizer.lr == 5e-4 and cfg.optimizer.betas == (0.8, 0.99)
    assert cfg.train.compile_model is False and cfg.data.dataset_path == "/data/shards"
    assert cfg.metrics.wandb_run_name == "a b"
    texts = load_job_config(None, ["--data.dataset_path=123", "--metrics.wandb_run_name=2024-01-01"])
    assert texts.data.dataset_path == "123" and texts.metrics.wandb_run_name == "2024-01-01"


def test_parse_literal_falls_back_to_string():
    assert parse_literal("3") == 3 and parse_literal("true") is True and parse_literal("runs/x") == "runs/x"


def test_every_error_at_once_with_suggestions(tmp_path):
    preset = write(
        tmp_path, '[model]\nn_layrs = 3\nnorm_type = "batchnorm"\n[train]\nbatch_size = -1\n[optimzer]\nlr = 1\n'
    )
    with pytest.raises(ConfigError) as info:
        load_job_config(preset, ["--train.max_steps=abc"])
    issues = {i.path: i for i in info.value.issues}
    assert set(issues) == {"model.n_layrs", "model.norm_type", "train.batch_size", "train.max_steps", "optimzer"}
    assert "model.n_layers" in issues["model.n_layrs"].hint
    assert "'optimizer'" in issues["optimzer"].hint
    assert "batchnorm" in issues["model.norm_type"].problem


def test_bad_override_syntax(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_job_config(None, ["--train", "--a.b.c=1"])
    assert len(info.value.issues) == 2


def test_missing_and_malformed_preset(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_job_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_job_config(write(tmp_path, "[model\ndim = 3"))


@pytest.mark.parametrize(
    "override,path",
    [
        ("--model.dim=100", "model"),  # not divisible by n_heads
        ("--model.n_kv_heads=3", "model"),  # n_heads not divisible
        ("--scheduler.min_lr_ratio=2", "scheduler.min_lr_ratio"),
        ("--optimizer.lr=-1", "optimizer.lr"),
        ("--optimizer.lr=inf", "optimizer.lr"),
        ("--optimizer.betas=[1.5,0.9]", "optimizer.betas.0"),
        ("--train.grad_clip_norm=nan", "train.grad_clip_norm"),
        ("--data.prefetch_factor=2", "data"),
        ("--distributed.backend=cpu:glooo", "distributed.backend"),
    ],
)
def test_section_rules(override, path):
    with pytest.raises(ConfigError) as info:
        load_job_config(None, [override])
    assert paths(info.value) == [path]


def test_cross_section_rules_all_reported():
    cfg = load_job_config(
        None,
        [
            "--train.seq_len=4096",
            "--model.max_seq_len=1024",
            "--eval.enabled=true",
            "--data.dataset_path=/x",
            "--scheduler.warmup_steps=5000",
            "--train.max_steps=100",
        ],
    )
    with pytest.raises(ConfigError) as info:
        check_config(cfg, 1)
    assert set(paths(info.value)) == {"train.seq_len", "eval.dataset_path"}


def test_each_rooms_rules_import_first_and_without_torch():
    """The cross-section rules live beside their rooms (engine/*/rules.py), and engine/plan/checks.py lists
    them (engine.config imports none of them): each module imports first, with no engine module loaded before it (no import
    cycle through `engine.config`), and pulls in no torch, so validate-config stays torch-free."""
    from engine.plan.checks import ERROR_RULES, WARNING_RULES

    modules = sorted({rule.__module__ for rule in (*ERROR_RULES, *WARNING_RULES)})
    rooms = ["engine.data.rules", "engine.model.rules", "engine.parallel.rules", "engine.train.rules"]
    assert set(rooms) <= set(modules) and all(re.fullmatch(r"engine\.\w+\.rules", name) for name in modules), modules
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'engine' or m.startswith('engine.')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
        "    assert 'torch' not in sys.modules, name\n"
        "    print(name)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == modules


def test_seed_schema_values_are_warnings_not_errors():
    """A warmup as long as the run and a capacity factor of 0 (dropless) are the seed schema's presets'
    values: they validate, with a warning that says what they mean."""
    cfg = check_config(
        load_job_config(
            REPO / "presets" / "debug_moe.toml",
            ["--scheduler.warmup_steps=50", "--train.max_steps=20", "--model.moe_capacity_factor=0"],
        ),
        1,
    )
    warnings = {w.path: w.problem for w in config_warnings(cfg, 1)}
    assert sorted(warnings) == ["model.moe_capacity_factor", "scheduler.warmup_steps"]
    assert "dropless" in warnings["model.moe_capacity_factor"]
    assert cfg.model.moe_capacity is None
    assert config_warnings(load_job_config(REPO / "presets" / "debug.toml"), 1) == []
    with pytest.raises(ConfigError, match="moe_capacity_factor"):
        load_job_config(REPO / "presets" / "debug_moe.toml", ["--model.moe_capacity_factor=-1"])


def test_layout_against_world_size():
    cfg = load_job_config(None, ["--distributed.dp_shard=2"])
    with pytest.raises(ConfigError) as info:
        check_config(cfg, 3)
    assert "distributed" in paths(info.value)
    assert "does not multiply" in str(info.value)
    with pytest.raises(ConfigError, match="tp"):
        check_config(load_job_config(None, ["--distributed.tp=3"]), 3)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_job_config(REPO / "presets" / "debug.toml", ["--model.n_kv_heads=3", "--model.n_heads=6"])
    again = load_job_config(write(tmp_path, dump_toml(cfg)))
    assert again == cfg


def test_registries_cover_every_choice():
    """Every string a config Literal allows has a builder registered (and nothing else)."""
    import engine.model.mlp
    import engine.model.norms
    import engine.model.transformer
    import engine.train.losses
    import engine.train.optim
    import engine.train.schedules  # noqa: F401
    from engine.config import registry

    def choices(model, field):
        return sorted(typing.get_args(model.model_fields[field].annotation))

    from engine.config.model import ModelConfig
    from engine.config.optimizer import OptimizerConfig
    from engine.config.scheduler import SchedulerConfig
    from engine.config.train import TrainConfig

    assert registry.NORMS.names() == choices(ModelConfig, "norm_type")
    assert registry.ACTIVATIONS.names() == choices(ModelConfig, "activation")
    assert registry.OPTIMIZERS.names() == choices(OptimizerConfig, "name")
    assert registry.SCHEDULERS.names() == choices(SchedulerConfig, "name")
    assert registry.LOSSES.names() == choices(TrainConfig, "loss_fn")
    assert registry.MODELS.names() == choices(ModelConfig, "model_type")
    assert registry.ROUTERS.names() == choices(ModelConfig, "moe_router")
    with pytest.raises(ValueError, match="did you mean 'cosine'"):
        registry.SCHEDULERS.get("cosin")


def test_job_config_defaults_are_valid():
    check_config(JobConfig(), 1)


def test_configuration_doc_lists_every_field():
    doc = (REPO / "docs" / "configuration.md").read_text()
    for section, info in JobConfig.model_fields.items():
        assert f"## `[{section}]`" in doc
        table = doc.split(reference.BEGIN.format(section=section))[1].split(reference.END.format(section=section))[0]
        for field in info.annotation.model_fields:
            assert f"| `{field}` |" in table, f"docs/configuration.md misses {section}.{field}"


def test_configuration_reference_is_up_to_date():
    """docs/configuration.md's tables are what `python -m engine.config.reference` generates from the schema."""
    result = subprocess.run(
        [sys.executable, "-m", "engine.config.reference", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_every_field_has_a_description_and_composed_sections_say_who_reads_each():
    """Replaces the `readers` checks (the hand-written tables are gone): every field has a description, and in the
    sections composed of components the "read by" column is the registry's: every component-owned field names the
    components whose config class declares it, every other field is shared."""
    from engine.config.registry import MODELS, OPTIMIZERS, SCHEDULERS

    docs = reference.all_field_docs()
    assert all(doc.description for doc in docs)
    for section, components in (("optimizer", OPTIMIZERS), ("scheduler", SCHEDULERS), ("model", MODELS)):
        for doc in (d for d in docs if d.section == section):
            owners = [c.name for c in components.components() if doc.name in c.config.model_fields]
            if len(owners) == len(components.names()):
                assert doc.read_by == (f"every {components.kind}",), doc
            else:
                assert doc.read_by == tuple(owners) and owners, doc
    muon_momentum = next(d for d in docs if d.section == "optimizer" and d.name == "muon_momentum")
    assert muon_momentum.read_by == ("muon",)
    # [data] and [metrics] are composed of source kinds and sinks: an owned field names its owners, a shared none.
    from engine.config.registry import METRICS_SINKS, SOURCE_KINDS

    for section, components in (("data", SOURCE_KINDS), ("metrics", METRICS_SINKS)):
        for doc in (d for d in docs if d.section == section):
            owners = [c.name for c in components.components() if doc.name in c.config.model_fields]
            assert doc.read_by == tuple(owners), doc
    assert next(d for d in docs if d.section == "data" and d.name == "hf_streaming").read_by == ("hf",)
    assert next(d for d in docs if d.section == "metrics" and d.name == "wandb_run_id").read_by == ("wandb",)
    rope_theta = next(d for d in docs if d.section == "model" and d.name == "rope_theta")
    assert rope_theta.read_by == ("transformer",)
    composed = ("optimizer", "scheduler", "data", "metrics", "model")
    assert all(doc.read_by == () for doc in docs if doc.section not in composed)


def test_reference_goes_stale_when_a_field_is_added(tmp_path):
    """A field added to a section without regenerating makes the check fail; one without a description cannot be
    generated at all."""
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert reference.render(doc) == doc
    new_field = (int, Field(3, ge=0, description="a field nobody documented yet"))
    model = create_model("ModelPlus", __base__=ModelConfig, new_knob=new_field)
    job = create_model("JobPlus", __base__=JobConfig, model=(model, Field(default_factory=model)))
    stale = reference.render(doc, job)
    assert stale != doc and "| `new_knob` | int | `3` | >= 0 | a field nobody documented yet |" in stale
    undocumented = create_model("ModelUnread", __base__=ModelConfig, new_knob=(int, Field(3)))
    with pytest.raises(ValueError, match=r"model\.new_knob needs"):
        reference.render(
            doc,
            create_model("JobUnread", __base__=JobConfig, model=(undocumented, Field(default_factory=undocumented))),
        )
    path = tmp_path / "configuration.md"
    path.write_text(doc.replace("| `dim` | int | `256` |", "| `dim` | int | `255` |"))
    assert reference.main(["--check", str(path)]) == 1
    assert reference.main([str(path)]) == 0 and path.read_text() == doc


@pytest.mark.parametrize(
    "overrides,world,expected",
    [
        (
            ["--distributed.cp=2", "--distributed.pp=2", "--train.grad_accum_steps=2"],
            4,
            {"distributed.pp"},
        ),  # not with cp yet
        (["--distributed.tp=2", "--model.ffn_hidden_dim=129"], 2, {"distributed.tp"}),
        (["--distributed.tp=2", "--train.seq_len=63", "--model.max_seq_len=64"], 2, {"train.seq_len"}),
        (
            ["--distributed.tp=2", "--model.num_experts=4", "--model.moe_packed_experts=false"],
            2,
            {"model.moe_packed_experts"},
        ),
        (
            [
                "--distributed.tp=2",
                "--model.num_experts=4",
                "--model.ffn_hidden_dim=258",
                "--model.moe_expert_ffn_multiplier=0.5",
            ],
            2,
            {"distributed.tp"},
        ),
        (["--distributed.tp=2", "--train.mixed_precision=fp8", "--train.fp8_recipe=rowwise"], 2, {"train.fp8_recipe"}),
        (["--distributed.dp_replicate=2", "--distributed.dp_shard=2"], 2, {"distributed"}),
    ],
)
def test_layout_rules(overrides, world, expected):
    cfg = load_job_config(None, overrides)
    with pytest.raises(ConfigError) as info:
        check_config(cfg, world)
    assert set(paths(info.value)) == expected


def test_valid_layouts_pass():
    moe_tp = ["--distributed.tp=2", "--model.num_experts=4", "--distributed.ep=2"]
    for overrides, world in [(["--distributed.tp=2"], 4), (["--distributed.dp_replicate=2"], 4), ([], 8), (moe_tp, 4)]:
        check_config(load_job_config(None, overrides), world)
