"""Golden outputs of `forge validate-config`: every preset, every seed-framework preset of the tests, and
malformed configs that trip each cross-section rule (each error, each warning, several at once).

Each case is recorded to `tests/golden/validate/NAME.txt`: the exit code, stdout and stderr of the command
with `--json`, then the same of the plain command (rendered as off a terminal: NO_COLOR, 200 columns). The
outputs hold nothing machine-dependent: presets are named by paths relative to the repository (the commands
run there), no file outside the repository is read, and validation prints no timings, so nothing is
normalised. tests/cli/test_validate_golden.py checks that they come out byte for byte the same.

Re-record (after a change meant to alter what validate-config prints; review the diff of the golden files):

    PYTHONPATH=$PWD python -m tests.helpers.validate_golden
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "validate"
WIDTH = 200
ENV = {"NO_COLOR": "1", "COLUMNS": str(WIDTH), "PYTHONUTF8": "1", "TERM": "dumb"}
RICH_OVERRIDES = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "LINES")
"""Variables Rich reads that would turn colour or a terminal on in the `forge` process (a CI may set them)."""

DEBUG, MOE, MIX = "presets/debug.toml", "presets/debug_moe.toml", "presets/mixture_debug.toml"
TWO_SOURCES = '--data.datasets=[{name="a",embedded="plays"},{name="b",embedded="poems"}]'
NF4 = ["--lora.enabled=true", "--lora.quantize_base=nf4"]


def declared_world_size(path: Path) -> int:
    """The --world-size of a preset's `# validate:` header line (1 without one)."""
    for line in path.read_text().splitlines():
        if match := re.fullmatch(r"# validate: forge validate-config \S+ --world-size (\d+)", line):
            return int(match.group(1))
    return 1


def preset_cases() -> dict[str, list[str]]:
    """Every preset of presets/ and tests/seed_presets/ at the world size its header declares."""
    cases = {}
    for folder, prefix in (("presets", "preset"), ("tests/seed_presets", "seed")):
        for path in sorted((REPO / folder).glob("*.toml")):
            cases[f"{prefix}-{path.stem}"] = [f"{folder}/{path.name}", "--world-size", str(declared_world_size(path))]
    return cases


# Layouts beyond the declared ones, and one malformed config (or several) per rule of the cross-section
# validation: the rule's function in a comment, then cases whose overrides trip it.
RULE_CASES: dict[str, list[str]] = {
    # other layouts of valid presets
    "layout-debug-fsdp4": [DEBUG, "--world-size", "4"],
    "layout-debug-hsdp-tp2": [DEBUG, "--world-size", "8", "--distributed.dp_replicate=2", "--distributed.tp=2"],
    "layout-debug-pp2-interleaved": [
        DEBUG,
        "--world-size",
        "2",
        "--distributed.pp=2",
        "--distributed.pp_schedule=interleaved_1f1b",
        "--train.grad_accum_steps=4",
        "--train.loss_fn=cross_entropy",
    ],
    "layout-debug-cp2-ring": [DEBUG, "--world-size", "4", "--distributed.cp=2", "--distributed.cp_method=ring"],
    "layout-moe-ep2-tp2": [MOE, "--world-size", "4", "--distributed.ep=2", "--distributed.tp=2"],
    "layout-moe-compile-ac-bf16": [
        MOE,
        "--train.compile_model=true",
        "--train.activation_checkpointing=selective",
        "--train.mixed_precision=bf16",
    ],
    "layout-8b-tp8-pp4-eval-steps": [
        "presets/8b.toml",
        "--world-size",
        "64",
        "--distributed.tp=8",
        "--distributed.pp=4",
        "--distributed.dp_shard=-1",
    ],
    "layout-lora-qlora-valid": [DEBUG, *NF4, "--lora.save_adapters_only=true"],
    "layout-lora-merge-valid": [DEBUG, "--lora.enabled=true", "--lora.merge_interval=50"],
    # cross_section_issues
    "seq-len-exceeds-max": [DEBUG, "--train.seq_len=512"],
    "eval-without-source": [DEBUG, "--data.dataset_path=shards/train"],
    "profiling-after-run": [
        DEBUG,
        "--profiling.enable=true",
        "--profiling.start_step=400",
        "--profiling.end_step=410",
    ],
    # hub_data_issues
    "hub-data-field-without-name": [DEBUG, "--data.hf_dataset_config=en", "--data.hf_dataset_revision=main"],
    "hub-eval-field-without-name": [DEBUG, "--eval.hf_dataset_split=test"],
    "hub-data-name-and-path": [
        DEBUG,
        "--data.hf_dataset_name=org/corpus",
        "--data.dataset_path=shards/train",
        "--data.tokenizer_path=tok.json",
        "--eval.enabled=false",
    ],
    "hub-eval-name-and-path": [DEBUG, "--eval.hf_dataset_name=org/corpus", "--eval.dataset_path=shards/val"],
    "hub-text-field-unread": [DEBUG, "--data.hf_dataset_text_field=content"],
    "hub-streaming-unread": [DEBUG, "--data.hf_streaming=true"],
    "hub-needs-tokenizer": [DEBUG, "--data.hf_dataset_name=org/corpus", "--eval.enabled=false"],
    "hub-valid-with-eval": [
        DEBUG,
        "--data.hf_dataset_name=org/corpus",
        "--data.tokenizer_path=tok.json",
        "--eval.hf_dataset_name=org/corpus",
        "--data.hf_streaming=true",
        "--data.hf_dataset_text_field=content",
    ],
    # optimization_issues
    "optimizer-field-unread": [DEBUG, "--optimizer.muon_momentum=0.9", "--optimizer.fused=true"],
    "optimizer-eps-unread-by-lion": [DEBUG, "--optimizer.name=lion", "--optimizer.eps=1e-6"],
    "scheduler-field-unread": [DEBUG, "--scheduler.stable_steps=10", "--scheduler.rex_alpha=2.0"],
    "loss-chunk-unread": [DEBUG, "--train.loss_fn=cross_entropy", "--train.ce_chunk_size=2048"],
    "fp8-recipe-unread": [DEBUG, "--train.fp8_recipe=rowwise"],
    "schedule-free-with-cosine": [DEBUG, "--optimizer.name=schedule_free_adamw"],
    "schedule-free-beta-zero": [
        DEBUG,
        "--optimizer.name=schedule_free_adamw",
        "--scheduler.name=constant",
        "--optimizer.betas=[0.0,0.999]",
    ],
    "cycles-beyond-run": [DEBUG, "--scheduler.cycles=[100,300]"],
    "cycles-count-beyond-run": [DEBUG, "--scheduler.cycles=300"],
    "wsd-stable-needs-decay": [DEBUG, "--scheduler.name=wsd", "--scheduler.stable_steps=100"],
    "wsd-stable-fills-run": [DEBUG, "--scheduler.name=wsd", "--scheduler.stable_steps=290"],
    # ema_issues
    "ema-warmup-without-decay": [DEBUG, "--train.ema_warmup=true"],
    "ema-with-pipeline": [
        DEBUG,
        "--world-size",
        "2",
        "--train.ema_decay=0.999",
        "--distributed.pp=2",
        "--train.grad_accum_steps=2",
        "--train.loss_fn=cross_entropy",
    ],
    "ema-with-schedule-free": [
        DEBUG,
        "--train.ema_decay=0.999",
        "--optimizer.name=schedule_free_adamw",
        "--scheduler.name=constant",
    ],
    # moe_issues
    "moe-fields-on-dense": [DEBUG, "--model.moe_top_k=4", "--model.moe_router=sigmoid_topk"],
    "moe-bias-schedule-unread": [MOE, "--model.moe_router=softmax_topk"],
    "moe-top-k-exceeds-experts": [MOE, "--model.moe_top_k=9"],
    "moe-frequency-exceeds-layers": [MOE, "--model.moe_frequency=5"],
    "moe-expert-groups-uneven": [MOE, "--model.moe_n_group=3"],
    "mtp-weight-without-depth": [DEBUG, "--model.mtp_loss_weight=0.1"],
    "mtp-with-pp-and-packing": [
        DEBUG,
        "--world-size",
        "2",
        "--model.mtp_depth=1",
        "--distributed.pp=2",
        "--train.grad_accum_steps=2",
        "--data.pack_sequences=true",
    ],
    "moe-expert-groups-too-few-experts": [
        MOE,
        "--model.moe_n_group=4",
        "--model.moe_topk_group=1",
        "--model.moe_top_k=3",
    ],
    "moe-compile-ac-fp32": [
        MOE,
        "--train.compile_model=true",
        "--train.activation_checkpointing=selective",
        "--train.mixed_precision=fp32",
    ],
    "moe-compile-ac-ep2": [
        MOE,
        "--world-size",
        "2",
        "--distributed.ep=2",
        "--train.compile_model=true",
        "--train.activation_checkpointing=full",
        "--train.mixed_precision=bf16",
    ],
    # layout_issues
    "world-size-zero": [DEBUG, "--world-size", "0"],
    "dp-shard-zero": [DEBUG, "--distributed.dp_shard=0"],
    "dp-shard-below-minus-one": [DEBUG, "--distributed.dp_shard=-2"],
    "degrees-do-not-multiply": [DEBUG, "--world-size", "2", "--distributed.dp_shard=3"],
    "degrees-do-not-divide": [DEBUG, "--world-size", "3", "--distributed.tp=2"],
    "tp-heads": [DEBUG, "--world-size", "4", "--distributed.tp=4"],
    "pp-exceeds-layers": [DEBUG, "--world-size", "8", "--distributed.pp=8"],
    # tensor_parallel_issues
    "tp-ffn-width": [DEBUG, "--world-size", "2", "--distributed.tp=2", "--model.ffn_hidden_dim=513"],
    "tp-seq-len": [DEBUG, "--world-size", "2", "--distributed.tp=2", "--train.seq_len=255"],
    "tp-expert-width": [MOE, "--world-size", "2", "--distributed.tp=2", "--model.moe_expert_ffn_multiplier=0.2988"],
    "tp-moe-unpacked": [MOE, "--world-size", "2", "--distributed.tp=2", "--model.moe_packed_experts=false"],
    "tp-fp8-rowwise": [
        DEBUG,
        "--world-size",
        "2",
        "--distributed.tp=2",
        "--train.mixed_precision=fp8",
        "--train.fp8_recipe=rowwise",
    ],
    # pipeline_issues
    "pp-interleaved-too-many-stages": [
        DEBUG,
        "--world-size",
        "4",
        "--distributed.pp=4",
        "--distributed.pp_schedule=interleaved_1f1b",
        "--train.grad_accum_steps=4",
        "--train.loss_fn=cross_entropy",
    ],
    "pp-1f1b-few-microbatches": [DEBUG, "--world-size", "2", "--distributed.pp=2", "--train.loss_fn=cross_entropy"],
    "pp-interleaved-uneven-rounds": [
        DEBUG,
        "--world-size",
        "2",
        "--distributed.pp=2",
        "--distributed.pp_schedule=interleaved_1f1b",
        "--train.grad_accum_steps=5",
        "--train.loss_fn=cross_entropy",
    ],
    "pp-eval-steps": [
        DEBUG,
        "--world-size",
        "2",
        "--distributed.pp=2",
        "--train.grad_accum_steps=3",
        "--train.loss_fn=cross_entropy",
    ],
    "pp-moe-sigmoid-full-ac": [
        MOE,
        "--world-size",
        "2",
        "--distributed.pp=2",
        "--train.grad_accum_steps=2",
        "--train.activation_checkpointing=full",
    ],
    "pp-chunked-loss-and-fp16": [
        DEBUG,
        "--world-size",
        "4",
        "--distributed.tp=2",
        "--distributed.pp=2",
        "--train.grad_accum_steps=2",
        "--train.mixed_precision=fp16",
    ],
    # expert_parallel_issues
    "ep-on-dense": [DEBUG, "--world-size", "2", "--distributed.ep=2"],
    "ep-experts-indivisible": [MOE, "--world-size", "3", "--distributed.ep=3", "--model.num_experts=8"],
    "ep-does-not-divide-dp-shard": [MOE, "--world-size", "3", "--distributed.ep=2"],
    "ep-unpacked-gradient-scale": [
        MOE,
        "--world-size",
        "2",
        "--distributed.ep=2",
        "--model.moe_packed_experts=false",
        "--model.moe_gradient_scale=true",
    ],
    "ep-with-cp": [MOE, "--world-size", "4", "--distributed.ep=2", "--distributed.cp=2"],
    # context_parallel_issues
    "cp-method-without-cp": [DEBUG, "--distributed.cp_method=ring"],
    "cp-seq-len": [DEBUG, "--world-size", "2", "--distributed.cp=2", "--train.seq_len=250"],
    "cp-seq-len-tp": [
        DEBUG,
        "--world-size",
        "6",
        "--model.n_kv_heads=6",
        "--distributed.cp=2",
        "--distributed.tp=3",
        "--train.seq_len=244",
    ],
    "cp-ulysses-heads": [DEBUG, "--world-size", "4", "--distributed.cp=4", "--distributed.cp_method=ulysses"],
    "cp-with-pp": [
        DEBUG,
        "--world-size",
        "4",
        "--distributed.cp=2",
        "--distributed.pp=2",
        "--train.grad_accum_steps=2",
        "--train.loss_fn=cross_entropy",
    ],
    "cp-with-moe": [MOE, "--world-size", "2", "--distributed.cp=2"],
    # lora_issues
    "lora-field-without-enabled": [DEBUG, "--lora.rank=4", "--lora.target_modules=['output']"],
    "lora-with-tp-pp-cp": [
        DEBUG,
        "--world-size",
        "8",
        "--lora.enabled=true",
        "--distributed.tp=2",
        "--distributed.pp=2",
        "--distributed.cp=2",
        "--train.grad_accum_steps=2",
        "--train.loss_fn=cross_entropy",
    ],
    "lora-with-ema-and-fp8": [DEBUG, "--lora.enabled=true", "--train.ema_decay=0.999", "--train.mixed_precision=fp8"],
    "lora-qlora-multi-process": [DEBUG, "--world-size", "2", *NF4, "--lora.save_adapters_only=true"],
    "lora-qlora-full-checkpoints-and-merge": [DEBUG, *NF4, "--lora.merge_interval=50"],
    "lora-merge-adapters-only": [
        DEBUG,
        "--lora.enabled=true",
        "--lora.merge_interval=50",
        "--lora.save_adapters_only=true",
    ],
    "lora-merge-schedule-free": [
        DEBUG,
        "--lora.enabled=true",
        "--lora.merge_interval=50",
        "--optimizer.name=schedule_free_adamw",
        "--scheduler.name=constant",
    ],
    "lora-reset-without-merge": [DEBUG, "--lora.enabled=true", "--lora.reset_optimizer_on_merge=true"],
    # mixture_issues, source_location_issues
    "mix-fields-without-sources": [
        DEBUG,
        "--data.mix_temperature=2.0",
        "--data.anneal_start_step=100",
        "--data.phases=[{start_step=10,dataset_weights={a=1.0}}]",
    ],
    "mix-sources-and-single-set": [
        MIX,
        "--data.dataset_path=shards/train",
        "--data.hf_dataset_name=org/corpus",
        "--data.tokenizer_path=tok.json",
    ],
    "mix-source-nowhere": [DEBUG, '--data.datasets=[{name="a"},{name="b",embedded="poems"}]'],
    "mix-source-twice": [
        DEBUG,
        '--data.datasets=[{name="a",embedded="plays",path="shards/a",hf_name="org/a"},{name="b",embedded="poems"}]',
    ],
    "mix-hub-fields-without-hf-name": [
        DEBUG,
        '--data.datasets=[{name="a",embedded="plays",hf_split="test",text_field="body"},{name="b",embedded="poems"}]',
    ],
    "mix-hub-sources-need-tokenizer": [
        DEBUG,
        '--data.datasets=[{name="a",hf_name="org/a"},{name="b",hf_name="org/b",hf_config="en"}]',
    ],
    "mix-hub-source-valid": [
        DEBUG,
        '--data.datasets=[{name="a",embedded="plays"},{name="b",hf_name="org/b",hf_config="en"}]',
        "--eval.enabled=false",
    ],
    "mix-duplicate-names": [DEBUG, '--data.datasets=[{name="a",embedded="plays"},{name="a",embedded="poems"}]'],
    "mix-anneal-without-weights": [DEBUG, TWO_SOURCES, "--data.anneal_start_step=100"],
    "mix-anneal-without-start": [DEBUG, TWO_SOURCES, "--data.anneal_weights={b=1.0}"],
    "mix-phases-and-anneal": [MIX, "--data.phases=[{start_step=100,dataset_weights={plays=1.0}}]"],
    "mix-phases-bad": [
        MIX,
        "--data.anneal_start_step=100",
        "--data.phases=[{start_step=200,dataset_weights={plays=1.0}},{start_step=150,dataset_weights={}},"
        "{start_step=300,dataset_weights={prose=1.0,plays=2.0}}]",
    ],
    "mix-anneal-bad": [MIX, "--data.anneal_start_step=300", "--data.anneal_weights={verse=1.0}"],
    "mix-phases-valid": [
        DEBUG,
        TWO_SOURCES,
        "--data.phases=[{start_step=100,dataset_weights={a=1.0},lr_scale=0.5},{start_step=200,dataset_weights={b=1.0}}]",
    ],
    # config_warnings
    "warn-warmup-whole-run": [DEBUG, "--scheduler.warmup_steps=300"],
    "warn-seed-ep-convention": [MOE, "--world-size", "4", "--distributed.dp_shard=2", "--distributed.ep=2"],
    "warn-capacity-zero": [MOE, "--model.moe_capacity_factor=0"],
    "warn-all-three": [
        MOE,
        "--world-size",
        "4",
        "--distributed.dp_shard=2",
        "--distributed.ep=2",
        "--model.moe_capacity_factor=0",
        "--scheduler.warmup_steps=250",
        "--train.max_steps=250",
    ],
    "warn-hidden-by-errors": [
        MOE,
        "--model.moe_capacity_factor=0",
        "--scheduler.warmup_steps=300",
        "--model.moe_top_k=9",
    ],
    # several rooms' errors at once: their order is the validation's order
    "many-errors-every-room": [
        DEBUG,
        "--world-size",
        "4",
        "--train.seq_len=512",
        "--data.dataset_path=shards/train",
        "--data.hf_streaming=true",
        "--profiling.enable=true",
        "--profiling.start_step=400",
        "--profiling.end_step=410",
        "--optimizer.muon_momentum=0.9",
        "--scheduler.cycles=400",
        "--train.ema_warmup=true",
        "--model.moe_top_k=4",
        "--distributed.tp=4",
        "--distributed.cp_method=ring",
        "--lora.rank=4",
        "--data.mix_temperature=2.0",
    ],
    "many-errors-moe-layout": [
        MOE,
        "--world-size",
        "8",
        "--distributed.tp=2",
        "--distributed.pp=2",
        "--distributed.ep=2",
        "--distributed.cp=2",
        "--model.moe_packed_experts=false",
        "--model.moe_gradient_scale=true",
        "--train.ema_decay=0.99",
        "--train.compile_model=true",
        "--train.activation_checkpointing=full",
        "--train.mixed_precision=fp16",
        "--train.loss_fn=chunked_cross_entropy",
        "--lora.enabled=true",
    ],
    # field-level errors (pydantic), which the cross-section rules never see
    "field-errors": [DEBUG, "--model.n_layrs=3", "--optimizer.lr=-1", "--train.mixed_precision=fp4"],
    "section-rule-errors": [
        DEBUG,
        "--profiling.start_step=9",
        "--data.prefetch_factor=2",
        "--checkpoint.exclude_from_loading=['output.']",
    ],
    "preset-missing": ["presets/no_such_preset.toml"],
    # family_issues (and lora_issues' refusal of a family with biased linears)
    "gpt2-fields-of-other-families": [
        "presets/gpt2_124m.toml",
        "--world-size",
        "8",
        "--model.qk_norm=true",
        "--model.rope_theta=500000",
        "--model.moe_top_k=1",
        "--lora.enabled=true",
    ],
    "layout-gpt2-tp2-pp2": [
        "presets/gpt2_124m.toml",
        "--world-size",
        "8",
        "--distributed.tp=2",
        "--distributed.pp=2",
        "--distributed.pp_schedule=1f1b",
    ],
    "layout-gpt2-cp2-tp2": ["presets/gpt2_124m.toml", "--world-size", "8", "--distributed.cp=2", "--distributed.tp=2"],
    # μP (engine/model/mup.py): the multipliers shown, and each refusal
    "mup-valid-debug": [DEBUG, "--model.parametrization=mup", "--model.mup_base_dim=96"],
    "mup-base-dim-larger-than-dim": [DEBUG, "--model.parametrization=mup", "--model.mup_base_dim=384"],
    "mup-ffn-not-dividing": [
        DEBUG,
        "--model.parametrization=mup",
        "--model.mup_base_dim=64",
        "--model.ffn_hidden_dim=500",
    ],
    "mup-base-dim-without-mup": [DEBUG, "--model.mup_base_dim=96"],
    "mup-muon": [DEBUG, "--model.parametrization=mup", "--model.mup_base_dim=96", "--optimizer.name=muon"],
    # memory options (issue 38): the estimate with each, and where each is refused
    "memory-int8-offload-checkpointed": [
        DEBUG,
        "--optimizer.state_dtype=int8",
        "--train.activation_offload=true",
        "--train.activation_checkpointing=full",
        "--gpu-memory-gib",
        "80",
    ],
    "memory-8b-one-gpu-bf16": [
        "presets/8b.toml",
        "--optimizer.weight_dtype=bf16",
        "--optimizer.state_dtype=bf16",
        "--train.activation_checkpointing=full",
        "--train.loss_fn=chunked_cross_entropy",
        "--gpu-memory-gib",
        "80",
    ],
    "memory-bf16-refused": [
        DEBUG,
        "--optimizer.weight_dtype=bf16",
        "--train.mixed_precision=fp32",
        "--train.ema_decay=0.99",
    ],
    "memory-bf16-state-needs-bf16-weights": [DEBUG, "--optimizer.state_dtype=bf16"],
    "memory-options-refused": [
        DEBUG,
        "--world-size",
        "4",
        "--distributed.pp=2",
        "--train.grad_accum_steps=2",
        "--train.loss_fn=cross_entropy",
        "--optimizer.state_dtype=int8",
        "--optimizer.fused=true",
        "--train.activation_offload=true",
    ],
    "memory-8b-one-gpu-cpu-offload": ["presets/8b.toml", "--distributed.cpu_offload=true", "--gpu-memory-gib", "80"],
    "memory-cpu-offload-refused": [
        DEBUG,
        "--world-size",
        "4",
        "--distributed.tp=2",
        "--distributed.cpu_offload=true",
        "--optimizer.state_dtype=int8",
        "--lora.enabled=true",
    ],
}

CASES: dict[str, list[str]] = {**preset_cases(), **RULE_CASES}
SUBPROCESS_CASES = ("preset-debug_moe", "many-errors-every-room", "warn-all-three")
"""Cases the test also runs through the real `forge` process, to show the in-process runs print the same."""


def render(runs: list[tuple[list[str], int, str, str]]) -> str:
    """One golden file: each command, its exit code, stdout and stderr."""
    parts = []
    for argv, code, out, err in runs:
        parts.append(f"$ forge validate-config {' '.join(argv)}\nexit code: {code}\n--- stdout\n{out}--- stderr\n{err}")
    return "\n".join(parts)


def commands(argv: list[str]) -> list[list[str]]:
    """The two commands a case records: with --json, and plain."""
    return [[*argv, "--json"], argv]


@contextlib.contextmanager
def plain_consoles() -> Iterator[None]:
    """The CLI's consoles as a `forge` process has them off a terminal with NO_COLOR and COLUMNS=200 (its
    consoles are made at import, from the environment of that moment; here they are made for the run)."""
    from rich.console import Console

    from forgecli import ui, validate_config

    saved = ui.console, ui.err_console, validate_config.console
    out = Console(width=WIDTH, color_system=None, no_color=True, force_terminal=False, force_interactive=False)
    err = Console(
        stderr=True, width=WIDTH, color_system=None, no_color=True, force_terminal=False, force_interactive=False
    )
    ui.console, ui.err_console, validate_config.console = out, err, out
    try:
        yield
    finally:
        ui.console, ui.err_console, validate_config.console = saved


@functools.cache
def forge_command() -> Any:
    """The `forge` app as the click command Typer makes of it (made once: that takes longer than a validation)."""
    import typer

    from forgecli.app import app

    return typer.main.get_command(app)


def run_in_process(argv: list[str]) -> tuple[int, str, str]:
    """`forge validate-config ARGV` through the Typer app in this process (from the repository root), with the
    streams and environment Typer's CliRunner gives a command."""
    from typer.testing import CliRunner

    with contextlib.chdir(REPO), plain_consoles(), CliRunner().isolation(env=ENV) as (out, err, _):
        try:
            forge_command().main(["validate-config", *argv], prog_name="forge")
            code = 0
        except SystemExit as ended:
            code = ended.code or 0
        sys.stdout.flush()
        sys.stderr.flush()
        return code, out.getvalue().decode(), err.getvalue().decode()


def run_subprocess(argv: list[str]) -> tuple[int, str, str]:
    """`forge validate-config ARGV` as a user runs it, in its own process."""
    inherited = {key: value for key, value in os.environ.items() if key not in RICH_OVERRIDES}
    env = {**inherited, "PYTHONPATH": str(REPO), **ENV}
    done = subprocess.run(
        [sys.executable, "-m", "forgecli.app", "validate-config", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=120,
    )
    return done.returncode, done.stdout, done.stderr


def output(name: str, run=run_in_process) -> str:
    return render([(command, *run(command)) for command in commands(CASES[name])])


def record() -> None:
    """Write every case's golden file, and remove those of cases no longer listed."""
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for stale in set(GOLDEN.glob("*.txt")) - {GOLDEN / f"{name}.txt" for name in CASES}:
        stale.unlink()
    for name in CASES:
        (GOLDEN / f"{name}.txt").write_text(output(name), encoding="utf-8")
    print(f"recorded {len(CASES)} cases in {GOLDEN.relative_to(REPO)}")


if __name__ == "__main__":
    record()
