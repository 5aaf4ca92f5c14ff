"""Metric sinks (JSONL, TensorBoard, W&B offline), MFU arithmetic, the peak table, and memory stats."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils import flop_counter

from engine.config import JobConfig
from engine.errors import UserError
from engine.metrics.memory import memory_stats
from engine.metrics.mfu import mfu, peak_flops
from engine.metrics.trackers import build_trackers


def job(**metrics: object) -> JobConfig:
    cfg = JobConfig()
    cfg.metrics = cfg.metrics.model_copy(update=metrics)
    return cfg


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_jsonl_one_object_per_call_appended_on_reopen(tmp_path: Path):
    with build_trackers(job(), tmp_path) as logger:
        logger.log(1, {"loss": 2.5, "lr": 1e-3})
        logger.log(2, {"loss": 2.0, "lr": 1e-3})
    with build_trackers(job(), tmp_path) as logger:
        logger.log(3, {"loss": float("nan")})
    rows = records(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["loss"] == 2.5 and rows[0]["lr"] == 1e-3 and rows[0]["time"] > 0
    assert rows[2]["loss"] is None  # non-finite values stay valid JSON


def test_jsonl_is_flushed_per_line(tmp_path: Path):
    logger = build_trackers(job(), tmp_path)
    logger.log(1, {"loss": 1.0})
    assert records(tmp_path) == [{"step": 1, "time": records(tmp_path)[0]["time"], "loss": 1.0}]
    logger.close()


def test_tensorboard_writes_readable_event_files(tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with build_trackers(job(enable_tensorboard=True), tmp_path) as logger:
        logger.log(1, {"step": 1, "loss": 3.0, "mfu": None})
        logger.log(2, {"step": 2, "loss": 2.0, "mfu": 0.25})
    log_dir = tmp_path / "tensorboard"
    assert list(log_dir.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(log_dir))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"loss", "mfu"}
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 3.0), (2, 2.0)]
    assert [(e.step, e.value) for e in events.Scalars("mfu")] == [(2, 0.25)]


def test_tensorboard_dir_absolute(tmp_path: Path):
    target = tmp_path / "tb-elsewhere"
    with build_trackers(job(enable_tensorboard=True, tensorboard_dir=str(target)), tmp_path / "run") as logger:
        logger.log(1, {"loss": 1.0})
    assert list(target.glob("events.out.tfevents.*"))


def wandb_history(offline_run: Path) -> list[dict]:
    """The history rows (one per `run.log`) of a W&B offline run, read back from its `run-<id>.wandb` file,
    what `wandb sync` uploads. wandb has no Python reader for it (its service reads it), so this follows the
    file's format: a 7-byte header (b":W&B", magic 0xBEE1 as uint16 LE, version 0), then `Record` protobufs
    (wandb.proto.wandb_internal_pb2) in LevelDB-log style chunks: 32 KiB blocks, each chunk a 7-byte header
    (CRC-32, uint16 LE length, type: 1 whole record, 2 first, 3 middle, 4 last piece), a block's last
    < 7 bytes zero padding."""
    import struct

    import wandb
    from wandb.proto import wandb_internal_pb2

    wandb.teardown()  # `run.finish()` returns before W&B's service has written the file; this waits for it
    (path,) = offline_run.glob("run-*.wandb")
    data, block, header = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:header]) == (0xBEE1, 0), "not a W&B run file"
    rows, pos, pieces, kinds = [], header, b"", []
    while pos + header <= len(data):
        if block - pos % block < header:  # padding at the end of a block
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + header])
        assert kind in (1, 2, 3, 4), f"chunk type {kind} at byte {pos} of {path}"
        pieces += data[pos + header : pos + header + length]
        pos += header + length
        if kind in (1, 4):  # a record is complete
            record = wandb_internal_pb2.Record.FromString(pieces)
            pieces = b""
            kinds.append(record.WhichOneof("record_type"))
            if kinds[-1] == "history":
                items = record.history.item  # a key is `key`, or `nested_key` when W&B sends it in parts
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    assert kinds[-1:] == ["exit"] and not pieces, f"{path} is cut short: {kinds[-3:]}"  # the run's last record
    return rows


def test_wandb_offline_logs_the_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run-7"
    with build_trackers(job(enable_wandb=True), run_dir) as logger:
        logger.log(1, {"step": 1, "loss": 3.0, "mfu": None})
        logger.log(2, {"step": 2, "loss": 2.0, "mfu": 0.25})
    (offline_run,) = (run_dir / "wandb").glob("offline-run-*")
    rows = wandb_history(offline_run)  # W&B adds its own keys (_step, _runtime, _timestamp)
    assert [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows] == [
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 2.0, "mfu": 0.25},
    ]
    assert [r["step"] for r in records(run_dir)] == [1, 2]


@pytest.mark.parametrize(
    ("flag", "module"), [("enable_wandb", "wandb"), ("enable_tensorboard", "torch.utils.tensorboard")]
)
def test_missing_tracker_package_is_a_user_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: str, module: str
):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(UserError, match=f"metrics.{flag} = true") as err:
        build_trackers(job(**{flag: True}), tmp_path)
    assert "pip install" in err.value.hint


def test_mfu_arithmetic():
    assert mfu(flops_per_token=6e9, tokens_per_sec=50_000, peak=1e15) == pytest.approx(0.3)
    assert mfu(6e9, 50_000, None) is None


def grouped_mm_flop(a_shape, b_shape, *args, **kwargs) -> int:
    """torch's FlopCounterMode has no formula for grouped_mm. Each of the three uses (forward
    [T, K] × [E, K, N], input gradient the same, weight gradient [K, T] × [T, N] → [E, K, N]) multiplies
    every row of `a` once by a K × N (or T-long) slice of `b`: 2 · numel(a) · N."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


FLOP_FORMULAS = {  # the CPU attention kernels, counted by torch's own sdpa formulas (no causal saving)
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *args, **kwargs: (
        flop_counter.sdpa_flop_count(q, k, v)
    ),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: lambda grad, q, k, v, *args, **kwargs: (
        flop_counter.sdpa_backward_flop_count(grad, q, k, v)
    ),
    torch.ops.aten._grouped_mm: grouped_mm_flop,
}


@pytest.mark.parametrize(
    "fields", [{}, {"num_experts": 4, "moe_top_k": 2, "moe_shared_experts": 1}], ids=["dense", "moe"]
)
def test_training_flops_per_token_match_a_counted_forward_and_backward(fields):
    """`training_flops_per_token` against torch's FlopCounterMode over one real forward + backward, dense
    and MoE (torch 2.13, CPU): the matmuls (6 × active matmul parameters, the output head included, the
    embedding lookup not) agree exactly; attention differs by exactly 2 · layers · dim · seq_len, the
    QKᵀ that torch's sdpa backward formula counts as recomputed (forward 2 matmuls + backward 5) and the
    PaLM convention the estimate follows does not (forward 2 + backward 4)."""
    from torch.utils.flop_counter import FlopCounterMode

    from engine.config.model import ModelConfig
    from engine.config.train import TrainConfig
    from engine.model.estimate import training_flops_per_token
    from engine.model.transformer import Transformer
    from engine.train.losses import build_loss

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=32, **fields)
    batch, seq = 2, 32
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    model = Transformer(cfg)
    with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as counter:
        build_loss(TrainConfig())(model, tokens[:, :-1], tokens[:, 1:]).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert counts["aten._scaled_dot_product_flash_attention_for_cpu"] > 0 and counts["aten.mm"] > 0
    assert ("aten._grouped_mm" in counts) == bool(fields)
    recomputed_scores = 2 * cfg.n_layers * cfg.dim * seq
    assert counter.get_total_flops() == batch * seq * (training_flops_per_token(cfg, seq) + recomputed_scores)


@pytest.mark.parametrize(
    ("name", "dtype", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.5e12),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.5e12),
        ("NVIDIA H100 NVL", torch.float16, 835.5e12),
        ("NVIDIA H200", torch.bfloat16, 989.5e12),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),
        ("NVIDIA A10G", torch.bfloat16, 125e12),
        ("NVIDIA L4", torch.bfloat16, 121e12),
        ("NVIDIA L40S", torch.bfloat16, 362e12),
        ("NVIDIA GeForce RTX 4090", torch.float32, 82.6e12),
        ("Tesla V100-SXM2-16GB", torch.float16, 125e12),
        ("Tesla V100-SXM2-16GB", torch.bfloat16, None),  # no bf16 hardware: no honest peak
        ("AMD Instinct MI300X", torch.bfloat16, 1307.4e12),
        ("Some Future GPU", torch.bfloat16, None),
    ],
)
def test_peak_table_by_device_name(
    monkeypatch: pytest.MonkeyPatch, name: str, dtype: torch.dtype, expected: float | None
):
    monkeypatch.delenv("FORGE_PEAK_FLOPS", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda"), dtype) == expected


def test_fp32_counts_at_tf32_rate_when_allowed(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("FORGE_PEAK_FLOPS", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-40GB")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert peak_flops(torch.device("cuda"), torch.float32) == 19.5e12
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert peak_flops(torch.device("cuda"), torch.float32) == 156e12


def test_env_override(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FORGE_PEAK_FLOPS", "123e12")
    assert peak_flops(torch.device("cpu"), torch.float32) == 123e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(torch.device("cuda"), torch.bfloat16) == 123e12


@pytest.mark.parametrize("value", ["fast", "0", "-5e12", "nan"])
def test_bad_env_override_is_a_user_error(monkeypatch: pytest.MonkeyPatch, value: str):
    monkeypatch.setenv("FORGE_PEAK_FLOPS", value)
    with pytest.raises(UserError, match="FORGE_PEAK_FLOPS"):
        peak_flops(torch.device("cpu"), torch.float32)


ZEN4_KVM = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
cpu MHz\t\t: 2596.138
siblings\t: 2
cpu cores\t: 2
flags\t\t: fpu lm fma avx avx2 avx512f avx512bw avx512_bf16

processor\t: 1
vendor_id\t: AuthenticAMD
"""

SPR = """vendor_id\t: GenuineIntel
cpu family\t: 6
model name\t: Intel(R) Xeon(R) Platinum 8480+ @ 2.00GHz
cpu MHz\t\t: 1900.000
siblings\t: 112
cpu cores\t: 56
flags\t\t: fpu lm fma avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile
"""


@pytest.mark.parametrize(
    ("cpuinfo", "max_khz", "logical", "threads", "dtype", "expected"),
    [
        # Zen 4 runs AVX-512 on two 256-bit FMA units: 2 cores × 2 FLOP × 8 lanes × 2 units × 2.596 GHz
        (ZEN4_KVM, None, 2, 2, "float32", 2 * 32 * 2596.138e6),
        (ZEN4_KVM, None, 2, 1, "float32", 1 * 32 * 2596.138e6),  # one thread: one core's units
        (ZEN4_KVM, None, 2, 8, "float32", 2 * 32 * 2596.138e6),  # more threads than cores add nothing
        (ZEN4_KVM, None, 2, 2, "bfloat16", 2 * 64 * 2596.138e6),  # VDPBF16PS: twice the fp32 rate
        (ZEN4_KVM, None, 2, 2, "float16", 2 * 32 * 2596.138e6),  # no fp16 math: converted to fp32
        (
            ZEN4_KVM.replace("family\t: 25", "family\t: 26"),
            None,
            2,
            2,
            "float32",
            2 * 64 * 2596.138e6,
        ),  # Zen 5: 512-bit units
        (ZEN4_KVM, "3700000", 2, 2, "float32", 2 * 32 * 3.7e9),  # cpufreq's boost clock wins over cpu MHz
        # Sapphire Rapids: clock from the model name; 112 logical CPUs are 56 cores (SMT 2); AMX for bf16
        (SPR, None, 112, 112, "float32", 56 * 64 * 2.0e9),
        (SPR, None, 112, 112, "bfloat16", 56 * 1024 * 2.0e9),
    ],
)
def test_cpu_peak_from_its_description(cpuinfo, max_khz, logical, threads, dtype, expected):
    from engine.metrics.cpu_peak import describe

    cpu = describe(cpuinfo, max_khz, logical)
    assert cpu is not None
    assert cpu.peak(dtype, threads) == pytest.approx(expected)


def test_cpu_without_a_description_has_no_peak():
    from engine.metrics.cpu_peak import describe

    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n"
    assert describe(arm, None, 4) is None
    assert describe(ZEN4_KVM.replace("cpu MHz\t\t: 2596.138\n", ""), None, 2) is None  # no clock stated


def test_cpu_peak_is_this_machines_description_not_a_timing(monkeypatch: pytest.MonkeyPatch):
    """The peak the trainer divides by is the same figure every time (no micro-benchmark), at least what
    this machine's description allows, and MFU never comes out above 1."""
    from engine.metrics.cpu_peak import this_cpu

    monkeypatch.delenv("FORGE_PEAK_FLOPS", raising=False)
    cpu = this_cpu()
    if cpu is None:
        pytest.skip("no x86-64 /proc/cpuinfo here")
    peaks = {peak_flops(torch.device("cpu"), torch.float32) for _ in range(3)}
    assert peaks == {cpu.peak("float32", torch.get_num_threads())}
    assert mfu(1e6, 0.99 * peaks.pop() / 1e6, cpu.peak("float32", torch.get_num_threads())) == pytest.approx(0.99)
    assert mfu(1e6, 2e6, 1e12) is None  # 2e12 FLOP/s over a 1e12 peak: the peak is wrong, not 200%


def test_cpu_memory_stats():
    stats = memory_stats(torch.device("cpu"))
    assert stats["mem_peak_gib"] > 0
    if sys.platform.startswith("linux"):
        assert 0 < stats["mem_rss_gib"] <= stats["mem_peak_gib"] * 1.01


def test_cuda_memory_stats_keys(monkeypatch: pytest.MonkeyPatch):
    for fn, gib in (("memory_allocated", 1), ("memory_reserved", 2), ("max_memory_allocated", 3)):
        monkeypatch.setattr(torch.cuda, fn, lambda device=None, gib=gib: gib * 2**30)
    expected = {"mem_allocated_gib": 1.0, "mem_reserved_gib": 2.0, "mem_peak_gib": 3.0}
    assert memory_stats(torch.device("cuda")) == expected


def test_resume_drops_the_interrupted_attempts_records(tmp_path: Path):
    with build_trackers(job(), tmp_path) as logger:
        for step in range(1, 6):
            logger.log(step, {"loss": float(step)})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "lo')  # killed mid-line
    with build_trackers(job(), tmp_path, resumed_from=3) as logger:
        logger.log(4, {"loss": 40.0})
    assert [(r["step"], r["loss"]) for r in records(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_tensorboard_resume_purges_later_events(tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with build_trackers(job(enable_tensorboard=True), tmp_path) as logger:
        for step in range(1, 6):
            logger.log(step, {"loss": float(step)})
    with build_trackers(job(enable_tensorboard=True), tmp_path, resumed_from=2) as logger:
        logger.log(3, {"loss": 30.0})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_wandb_resume_continues_the_same_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    with build_trackers(job(enable_wandb=True), tmp_path / "run") as logger:
        logger.log(1, {"loss": 3.0})
        run_id = logger.wandb_run_id
    with build_trackers(job(enable_wandb=True), tmp_path / "run", resumed_from=1, wandb_run_id=run_id) as logger:
        logger.log(2, {"loss": 2.0})
        assert logger.wandb_run_id == run_id
    runs = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(f"-{run_id}" in r.name for r in runs)  # a second dir in the same second gets "-1"
    assert [[(row["step"], row["loss"]) for row in wandb_history(run)] for run in runs] == [[(1, 3.0)], [(2, 2.0)]]


def test_metrics_wandb_run_id_names_the_run_over_the_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`metrics.wandb_run_id` resumes that W&B run, even where the checkpoint recorded another; unset, the
    checkpoint's id (or none: a new run). A stand-in `wandb` module records what `wandb.init` was asked."""
    asked: list[dict] = []

    class Run:
        def __init__(self, **kwargs: object) -> None:
            asked.append(kwargs)
            self.id = kwargs["id"] or "fresh"

        def define_metric(self, *args: object, **kwargs: object) -> None: ...

        def finish(self) -> None: ...

    fake = type(sys)("wandb")
    fake.init = Run
    fake.errors = type(sys)("wandb.errors")
    fake.errors.Error = RuntimeError
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with build_trackers(job(enable_wandb=True, wandb_run_id="elsewhere-1"), tmp_path, wandb_run_id="ckpt") as logger:
        assert logger.wandb_run_id == "elsewhere-1"
    with build_trackers(job(enable_wandb=True), tmp_path, wandb_run_id="ckpt") as logger:
        assert logger.wandb_run_id == "ckpt"
    with build_trackers(job(enable_wandb=True), tmp_path) as logger:
        assert logger.wandb_run_id == "fresh"
    assert [(a["id"], a["resume"]) for a in asked] == [("elsewhere-1", "allow"), ("ckpt", "allow"), (None, None)]
