"""Multi-process training as a user starts it (`forge train --nproc-per-node 2`, gloo on CPU): every layout
computes what one process computes on the same global batch, and a run moves between layouts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from engine.checkpoint.dcp import latest_checkpoint, load_checkpoint
from engine.config import load_job_config
from engine.data.loader import open_eval_data
from engine.model.transformer import Transformer
from tests.conftest import REPO
from tests.helpers import layouts
from tests.helpers.layouts import (
    CONTEXT_PARALLEL,
    PIPELINE,
    PIPELINE_LAYOUT,
    TINY,
    assert_same_run,
    assert_same_source_losses,
    child_env,
    forge,
    records,
    tolerance,
)
from tests.helpers.torchrun import kill_tree, run_bounded

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("layouts") / "single"
    result = forge(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


# presets/debug.toml trains with the chunked cross-entropy, which reads the head's weight after the forward:
# "fsdp" checks that FSDP still averages that weight's gradient; "fsdp_cross_entropy" the plain loss. "tp" takes
# the plain loss too, which under tp is loss parallel (vocabulary-sharded logits, engine.parallel.tp);
# "tp_chunked_ce_full_ac" covers the chunked loss under tp. "hsdp_cpu_offload" runs HSDP with FSDP2's CPU
# offload (distributed.cpu_offload; on a CPU it moves nothing, so it must match like the rest; plain HSDP is
# test_hybrid_sharded_data_parallel_2x2_matches_one_process).
LAYOUTS = {
    "fsdp": ([], 2),
    "fsdp_cross_entropy": (["--train.loss_fn=cross_entropy"], 2),
    "hsdp_cpu_offload": (
        ["--distributed.dp_replicate=2", "--distributed.dp_shard=1", "--distributed.cpu_offload=true"],
        2,
    ),
    "tp": (["--distributed.tp=2", "--distributed.dp_shard=1", "--train.loss_fn=cross_entropy"], 4),
    "pp_gpipe": ([*PIPELINE, "--distributed.pp_schedule=gpipe"], 2),
    "pp_1f1b_chunked_ce": ([*PIPELINE_LAYOUT, "--distributed.pp_schedule=1f1b"], 2),
    "pp_interleaved_selective_ac": (
        [*PIPELINE, "--distributed.pp_schedule=interleaved_1f1b", "--train.activation_checkpointing=selective"],
        2,
    ),
    "tp_chunked_ce_full_ac": (
        [
            "--distributed.tp=2",
            "--distributed.dp_shard=1",
            "--train.loss_fn=chunked_cross_entropy",
            "--train.ce_chunk_size=48",
            "--train.activation_checkpointing=full",
        ],
        4,
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_match_one_process(tmp_path, one_process, layout, parity):
    args, batch_size = LAYOUTS[layout]
    result = forge(tmp_path / "run", *args, nproc=2, batch_size=batch_size)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(tmp_path / "run", one_process, parity)
    assert all(any(k.startswith("loss/") for k in r) for r in records(one_process).values()), "per-source losses"
    metrics = records(tmp_path / "run")[6]
    assert {"mem_peak_gib/rank0", "mem_peak_gib/rank1"} <= metrics.keys()
    assert metrics["mem_peak_gib"] == max(metrics["mem_peak_gib/rank0"], metrics["mem_peak_gib/rank1"])
    assert "step 6/6" in result.stdout and result.stdout.count("run directory:") == 1  # rank 0 alone reports
    assert ("distributed.cpu_offload" in result.stdout + result.stderr) == ("cpu_offload" in layout)  # its warning
    state = json.loads((latest_checkpoint(tmp_path / "run" / "checkpoints")[1] / "train_state.json").read_text())
    assert len(state["rng"]) == 2, "each rank's generators are saved"


MTP = ["--model.mtp_depth=1", "--model.mtp_loss_weight=0.5"]  # one multi-token-prediction module (engine/model/mtp.py)


def test_a_global_batch_and_the_whole_held_out_set_on_two_processes_match_one(tmp_path, parity):
    """--train.global_batch_size=32 on 2 processes (8 sequences × 2 micro-batches per rank, derived) trains like
    one process accumulating 4 micro-batches of 8 (today's explicit form), and eval.steps = "all" (every held-out
    window once, chunk c of 8 on rank c mod 2) gives one process's token-weighted mean, which is the mean
    cross-entropy over every held-out window computed here from the final weights. Tolerance: as for every layout
    here (assert_same_run: tests/helpers/parity.TrainingTolerance): the same windows in the same micro-batches, but FSDP sums the two ranks'
    gradients in another order than one process's accumulation, fp32 rounding that Adam carries over the 6
    steps; each eval chunk is the same rows on either side and the chunks' sums are taken in float64. Both runs
    train with a multi-token-prediction module, whose logged main and depth losses match too (the eval loss is
    the main model's). (Padding a
    rank that runs out of chunks is checked in tests/train/test_length.py: here the 360 chunks split evenly.)"""
    one, two = tmp_path / "one", tmp_path / "two"
    result = forge(one, "--train.grad_accum_steps=4", "--eval.steps=all", *MTP, batch_size=8)
    assert result.returncode == 0, result.stderr[-3000:]
    result = forge(two, "--train.global_batch_size=32", "--eval.steps=all", *MTP, nproc=2, batch_size=8)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(two, one, parity)
    tol = tolerance(two)  # with multi-token prediction: its main and per-depth losses, FSDP against one process
    for step, record in records(two).items():
        for key in ("loss_main", "mtp/loss_1"):
            parity.within(f"{key} step {step}", abs(record[key] - records(one)[step][key]), tol.loss_at(step))
    assert [r["tokens_seen"] for r in records(two).values()] == [32 * 32 * s for s in range(1, 7)]
    saved = (two / "config.toml").read_text()  # the layout's accumulation is derived again on a resume
    assert "global_batch_size = 32" in saved and "grad_accum_steps" not in saved

    held_out = open_eval_data(load_job_config(two / "config.toml")).dataset
    model = Transformer(load_job_config(one / "config.toml").model)
    load_checkpoint(latest_checkpoint(one / "checkpoints")[1], model)  # step 6, the last eval's weights
    total, count = 0.0, 0
    with torch.no_grad():
        for first in range(0, len(held_out), 64):
            inputs, labels = (
                torch.stack(t) for t in zip(*(held_out[i] for i in range(first, min(first + 64, len(held_out)))))
            )
            logits = model(inputs)
            total += (
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
                .double()
                .item()
            )
            count += labels.numel()
    assert len(held_out) % 8 and count == len(held_out) * 32  # every window, the last chunk a short one
    assert records(two, "eval_loss")[6]["eval_loss"] == pytest.approx(total / count, abs=1e-5)


# The runs that resume across layouts train under μP (engine/model/mup.py: its init, per-group learning
# rates, query scale and logit multiplier), so FSDP, tensor and context parallelism are shown to match one
# process with it at no extra launch; the layouts above cover sp.
MUP = ["--model.parametrization=mup", "--model.mup_base_dim=16"]


@pytest.fixture(scope="module")
def eight_steps(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("layouts") / "eight"
    result = forge(run_dir, "--train.max_steps=8", *MUP)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_a_sharded_run_resumes_in_one_process_and_back(tmp_path, eight_steps, parity):
    """FSDP 2 → one process, and one process → FSDP 2: the next step's loss is the uninterrupted run's."""
    reference = eight_steps
    sharded = tmp_path / "sharded"
    assert forge(sharded, *MUP, nproc=2).returncode == 0
    result = forge(sharded, "--train.max_steps=7", *MUP)  # the same global batch, now on one process
    assert result.returncode == 0, result.stderr[-3000:]
    result = forge(sharded, "--train.max_steps=8", *MUP, nproc=2)  # and back to two
    assert result.returncode == 0, result.stderr[-3000:]
    tol = tolerance(reference)
    for step in (7, 8):
        gap = abs(records(sharded)[step]["loss"] - records(reference)[step]["loss"])
        parity.within(f"loss step {step}", gap, tol.loss_at(step))


def test_a_context_parallel_run_resumes_in_one_process_and_back(tmp_path, eight_steps, parity):
    """cp = 2 (ulysses) → one process → cp = 2 (allgather), as a user runs it: both ranks read the same 4
    sequences and keep half of each; the sharded checkpoint loads in either layout, and each step's loss and
    per-source losses are the uninterrupted one-process run's."""
    run_dir = tmp_path / "run"
    result = forge(run_dir, *CONTEXT_PARALLEL, "--distributed.cp_method=ulysses", *MUP, nproc=2, batch_size=4)
    assert result.returncode == 0, result.stderr[-3000:]
    result = forge(run_dir, "--train.max_steps=7", *MUP)
    assert result.returncode == 0, result.stderr[-3000:]
    result = forge(run_dir, "--train.max_steps=8", *CONTEXT_PARALLEL, *MUP, nproc=2, batch_size=4)
    assert result.returncode == 0, result.stderr[-3000:]
    ours, reference = records(run_dir), records(eight_steps)
    tol = tolerance(eight_steps)
    assert sorted(ours) == list(range(1, 9))
    for step in range(1, 9):
        parity.within(f"loss step {step}", abs(ours[step]["loss"] - reference[step]["loss"]), tol.loss_at(step))
        assert_same_source_losses(ours[step], reference[step], parity, tol.loss_at(step))
    evals, expected = records(run_dir, "eval_loss"), records(eight_steps, "eval_loss")
    common = sorted(evals.keys() & expected.keys())
    assert {3, 6, 8} <= set(common), (sorted(evals), sorted(expected))  # 3 and 6 under cp = 2 (ulysses), 8 allgather
    for step in common:
        gap = abs(evals[step]["eval_loss"] - expected[step]["eval_loss"])
        parity.within(f"eval loss step {step}", gap, tol.loss_at(step + 1))


def test_a_tensor_parallel_checkpoint_resumes_under_fsdp(tmp_path, eight_steps, parity):
    run_dir = tmp_path / "run"
    result = forge(run_dir, "--distributed.tp=2", "--distributed.dp_shard=1", *MUP, nproc=2, batch_size=4)
    assert result.returncode == 0, result.stderr[-3000:]
    result = forge(run_dir, "--train.max_steps=7", *MUP, nproc=2)  # dp_shard = 2, two sequences per rank
    assert result.returncode == 0, result.stderr[-3000:]
    gap = abs(records(run_dir)[7]["loss"] - records(eight_steps)[7]["loss"])
    parity.within("loss step 7", gap, tolerance(eight_steps).loss_at(7))


def test_resuming_with_another_global_batch_is_refused(tmp_path, one_process):
    run_dir = tmp_path / "run"
    shutil.copytree(one_process, run_dir)
    result = forge(run_dir, "--train.max_steps=7", "--train.batch_size=8")  # 8 sequences a step, not 4
    assert result.returncode == 2, result.stderr[-3000:]
    assert "tokens per step" in result.stderr and "train.batch_size" in result.stderr
    assert sorted(records(run_dir)) == list(range(1, 7))


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (["--distributed.dp_shard=4"], "does not multiply to the world size 2"),
        (["--distributed.tp=2", "--distributed.dp_shard=1", "--model.n_kv_heads=1"], "divisible by tp"),
        (["--distributed.ep=2"], "needs a mixture-of-experts model"),
        (
            [
                "--distributed.pp=2",
                "--distributed.dp_shard=1",
                "--distributed.pp_schedule=gpipe",
                "--train.grad_accum_steps=2",
                "--eval.steps=3",
            ],
            "set eval.steps to a multiple of 2",
        ),
    ],
)
def test_bad_layouts_exit_2_before_any_process_starts(tmp_path, layout, message):
    result = forge(tmp_path / "run", *layout, nproc=2)
    assert result.returncode == 2, result.stderr[-3000:]
    assert message in result.stdout + result.stderr
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> tuple[list[str], Path]:
    """Short documents and one process's packed run on them (tests/helpers/layouts.short_documents)."""
    return layouts.short_documents(tmp_path_factory)


# Packed windows of short documents under each layout whose stages or ranks see only part of the model or of
# the window, against the one-process packed run: (arguments, processes, per-device batch).
PACKED_LAYOUTS = {
    # every pipeline stage attends within documents and restarts RoPE positions at each
    # (gpipe and interleaved 1F1B with packing: tests/parallel/test_pipeline.py)
    "pp_1f1b": ([*PIPELINE, "--distributed.pp_schedule=1f1b"], 2, 2),
    # each stage also tensor parallel, its activations sequence-sharded: the stages' masks and positions use
    # whole-sequence ids on every rank, attention running after the sequence gather
    "pp_tp_interleaved": ([*PIPELINE, "--distributed.tp=2", "--distributed.pp_schedule=interleaved_1f1b"], 4, 2),
    # the trainer takes each window's document ids from the whole window before the cp split
    # (every method, and cp × tp: tests/parallel/test_context_parallel.py)
    "cp_ring": ([*CONTEXT_PARALLEL, "--distributed.cp_method=ring"], 2, 4),
}


@pytest.mark.parametrize("layout", list(PACKED_LAYOUTS))
def test_packed_windows_match_one_process(tmp_path, short_documents, layout, parity):
    """data.pack_sequences as a user runs it under pp, pp × tp and cp: losses, gradient norms, per-source losses,
    evaluation and the step-6 weights within the derived fp32 tolerances of the one-process packed run's (which are not the unpacked
    run's: see short_documents). The unpacked pp × tp layout ran on the two-source mixture in this file up to
    commit efdcb93; the pp-only layouts above still do."""
    source, packed = short_documents
    args, nproc, batch_size = PACKED_LAYOUTS[layout]
    result = forge(tmp_path / "run", *source, "--data.pack_sequences=true", *args, nproc=nproc, batch_size=batch_size)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(tmp_path / "run", packed, parity)


def test_hybrid_sharded_data_parallel_2x2_matches_one_process(tmp_path, one_process, parity):
    """HSDP on four processes: 2 replicas, each FSDP-sharded over 2 ranks (the hsdp layout above is 2 × 1,
    pure replication, which never shards); one sequence per rank, the one-process run's global batch."""
    result = forge(tmp_path / "run", "--distributed.dp_replicate=2", "--distributed.dp_shard=2", nproc=4)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(tmp_path / "run", one_process, parity)
    checkpoint = dcp.FileSystemReader(latest_checkpoint(tmp_path / "run" / "checkpoints")[1]).read_metadata()
    wq = checkpoint.state_dict_metadata["model.layers.0.attention.wq.weight"]
    assert len(wq.chunks) == 2, "each weight is sharded in two within a replica (the 2 × 1 layout saves 1 chunk)"


def test_a_preempted_multi_process_run_exits_75_and_resumes(tmp_path):
    """SIGUSR1 to `forge train --nproc-per-node 2` (what SLURM's --signal sends): the launcher passes it on,
    every rank saves, the command exits 75, and `forge resume --nproc-per-node 2` continues the run."""
    import signal
    import time

    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "forgecli.app",
        "train",
        "presets/debug.toml",
        "--run-dir",
        str(run_dir),
        *TINY,
        "--train.batch_size=2",
        "--train.max_steps=400",
        "--eval.enabled=false",
        "--checkpoint.interval=1000",
        "--nproc-per-node=2",
    ]
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if (run_dir / "metrics.jsonl").exists() and records(run_dir):
                break
            time.sleep(0.01)
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=120)
    finally:
        kill_tree(proc)
    assert proc.returncode == 75, err[-3000:]
    assert "forge resume" in err and "--nproc-per-node 2" in err
    stopped = max(records(run_dir))
    assert latest_checkpoint(run_dir / "checkpoints")[0] == stopped
    result = run_bounded(
        [
            sys.executable,
            "-m",
            "forgecli.app",
            "resume",
            str(run_dir),
            "--nproc-per-node=2",
            f"--train.max_steps={stopped + 2}",
        ],
        timeout=240,
        cwd=REPO,
        env=child_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(records(run_dir)) == list(range(1, stopped + 3))


def test_ranks_come_from_torchrun_or_srun_variables():
    from engine.parallel.place import ProcessPlace, process_place, slurm_rendezvous_env

    assert process_place({}) == ProcessPlace(0, 0, 1)
    assert process_place({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}) == ProcessPlace(3, 1, 4)
    srun = {
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "123456",
        "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7",
    }
    assert process_place(srun) == ProcessPlace(5, 1, 8)
    batch_script = {k: v for k, v in srun.items() if k != "SLURM_STEP_ID"}  # sbatch's own shell is not a task
    assert process_place(batch_script) == ProcessPlace(0, 0, 1)
    assert slurm_rendezvous_env(srun) == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": str(20000 + 123456 % 20000),
    }
    assert slurm_rendezvous_env({**srun, "MASTER_ADDR": "node1", "MASTER_PORT": "29400"})["MASTER_ADDR"] == "node1"


def test_each_rank_compiles_into_a_cache_of_its_own(tmp_path, monkeypatch):
    """A rank folder under the user's TORCHINDUCTOR_CACHE_DIR, or under PyTorch's default (tests/
    test_expert_parallel.py, `tp_compile_warm`, shows why: a shared one hands a rank another rank's backward)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from engine.parallel.launch import use_rank_compile_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    use_rank_compile_cache(3)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine" / "rank3")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    use_rank_compile_cache(0)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(os.path.abspath(default_cache_dir()), "rank0")


def test_backend_and_worker_command_line():
    from engine.errors import UserError
    from engine.parallel.launch import backend_for
    from forgecli.train import worker_argv

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert backend_for("cpu:gloo,cuda:nccl", cpu) == "gloo"
    assert backend_for("cpu:gloo,cuda:nccl", cuda) == "cpu:gloo,cuda:nccl"
    assert backend_for("gloo", cpu) == "gloo"
    with pytest.raises(UserError, match="no backend for CPU"):
        backend_for("cuda:nccl", cpu)
    argv = ["train", "p.toml", "--nproc-per-node", "2", "--train.max_steps=3", "--nproc-per-node=4"]
    assert worker_argv(argv) == ["train", "p.toml", "--train.max_steps=3"]


def test_a_multi_process_run_starts_from_checkpoint_load_path_like_one_process(tmp_path, one_process, parity):
    """Rank 0 alone reads the weights into its whole model; every rank receives its shards from it."""
    runs = {nproc: tmp_path / f"from{nproc}" for nproc in (1, 2)}
    for nproc, run_dir in runs.items():
        result = forge(run_dir, f"--checkpoint.load_path={one_process}", "--train.max_steps=2", nproc=nproc)
        assert result.returncode == 0, result.stderr[-3000:]
    first = {nproc: records(run_dir)[1]["loss"] for nproc, run_dir in runs.items()}
    parity.within("first loss", abs(first[2] - first[1]), tolerance(runs[1]).loss_at(1))
    assert first[1] < records(one_process)[1]["loss"] - 0.05  # trained weights, not a fresh initialisation


def test_ranks_end_without_interpreter_teardown(tmp_path):
    """gloo's threads outlive `destroy_process_group` (see `engine.parallel.launch.end_process`), and a rank
    that tore its interpreter down with them running could abort after finishing its work. Every rank ends
    through `end_process`, which runs no exit handlers: a `sitecustomize` exit handler marks any rank that
    did not (shown first to mark a plain process that has a RANK). The data-loader workers, which those
    handlers would have stopped, are gone by the time the launcher returns."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(
        "import atexit, os, pathlib\n"
        "if 'RANK' in os.environ:\n"
        f"    atexit.register(pathlib.Path({str(tmp_path)!r}, 'teardown_rank' + os.environ['RANK']).touch)\n"
    )
    mark = f"forge-test-{os.getpid()}-{tmp_path.name}"
    env = {**child_env(), "PYTHONPATH": f"{probe}{os.pathsep}{REPO}", "FORGE_TEST_MARK": mark}
    subprocess.run([sys.executable, "-c", "pass"], env={**env, "RANK": "7"}, check=True, timeout=60)
    assert (tmp_path / "teardown_rank7").exists(), "the probe marks a process that tears down"
    run_dir, log = tmp_path / "run", tmp_path / "out.log"
    with log.open("w") as out:  # not a pipe: waiting for the launcher alone, not for whoever holds its output
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "forgecli.app",
                "train",
                "presets/debug.toml",
                "--run-dir",
                str(run_dir),
                *TINY,
                "--train.max_steps=2",
                "--eval.interval=2",
                "--train.batch_size=2",
                "--data.num_workers=1",
                "--nproc-per-node=2",
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
            assert not marked_processes(mark), "data-loader workers outlived their rank"
        finally:
            kill_tree(proc)
    assert sorted(records(run_dir)) == [1, 2]
    assert sorted(p.name for p in tmp_path.glob("teardown_rank*")) == ["teardown_rank7"]


def marked_processes(mark: str) -> list[int]:
    """Processes whose environment holds FORGE_TEST_MARK=mark (the test's launcher and what it started)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"FORGE_TEST_MARK={mark}".encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found
