"""A training step makes the host wait for the device once: the bad-step guard's read of the loss and the
gradient norm (engine/train/step.py). Metrics, clipping and the loop's bookkeeping add no other read on steps
that are not logged (a logged step reads its metrics; an evaluation its loss).

Counted on CPU in one process, where the waits cannot be timed: every op that brings a device value to the host
(`aten._local_scalar_dense` and the data-dependent-shape ops, tests/model/test_moe_load.py SYNC_OPS) and every Tensor
method that reads values on the host (.item(), .tolist(), bool(), float(), …: on a CPU tensor these read memory
below dispatch), each with the engine line that asked for it. The data loader's reads are of host tensors it
builds itself (indices, sample ids), which stay on the host on a GPU too: they are told apart by their file."""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from engine.config import load_job_config
from engine.resilience.collectives import distributed
from engine.train.callbacks import Callback
from engine.train.trainer import train
from tests.conftest import REPO
from tests.helpers.moe import HOST_READS, SYNC_OPS, CountSyncs

ENGINE = str(REPO / "engine")


def caller() -> str:
    """The innermost engine file and function on the stack (the code that asked for the value)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(ENGINE):
            return f"{Path(name).relative_to(REPO)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "outside engine/"


class Reads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.calls.append(f"{HOST_READS[func]} at {caller()}")
        return func(*args, **(kwargs or {}))


class Ops(CountSyncs):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNC_OPS:
            self.calls.append(f"{func} at {caller()}")
        return func(*args, **(kwargs or {}))


class StepMarks(Callback):
    """Where each step starts in the record of reads."""

    def __init__(self, reads: Reads, ops: Ops) -> None:
        self.reads, self.ops, self.starts = reads, ops, {}

    def before_step(self, step, loop):
        self.starts[step] = (len(self.reads.calls), len(self.ops.calls), distributed())


def test_a_step_that_is_not_logged_reads_the_device_once(tmp_path):
    """In a process group (of one rank: the multi-process code path, its all-reduces included, in this process):
    steps 2 and 3 of 4, neither logged (log_interval 4: steps 1 and 4 are), with gradient clipping on, read
    exactly once, in `step_totals`. Before the bad-step decision and the stop signal rode that one read, each
    asked every rank with a collective of its own and read its answer (two more per step)."""
    tiny = ["model.dim=32", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2", "train.seq_len=32"]
    tiny += ["model.max_seq_len=32", "train.batch_size=2", "train.max_steps=4", "eval.enabled=false"]
    tiny += ["metrics.log_interval=4", "train.grad_clip_norm=0.5", "train.compile_model=false"]
    cfg = load_job_config(REPO / "presets" / "debug.toml", tiny)
    reads, ops = Reads(), Ops()
    marks = StepMarks(reads, ops)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        with reads, ops:
            summary = train(cfg, tmp_path / "run", [marks])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert summary["steps"] == 4 and sorted(marks.starts) == [1, 2, 3, 4]
    for step in (2, 3):
        (r0, o0, grouped), (r1, o1, _) = marks.starts[step], marks.starts[step + 1]
        assert grouped, "the step ran in a process group"
        device_reads = [c for c in reads.calls[r0:r1] if "engine/data/" not in c]
        assert device_reads == ["tolist at engine/train/step.py:step_totals"], (step, device_reads)
        assert ops.calls[o0:o1] == [], (step, ops.calls[o0:o1])
    assert any("engine/train/step.py:memory_per_rank" in c for c in reads.calls[marks.starts[4][0] :]), "logged"
