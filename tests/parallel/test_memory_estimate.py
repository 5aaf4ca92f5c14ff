"""The per-rank memory estimate (engine/parallel/memory.py) against what a real model holds, its sharding
arithmetic, and `forge validate-config --world-size N` printing it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from engine.config import load_job_config
from engine.config.job import JobConfig
from engine.model import build_model
from engine.model.estimate import param_counts
from engine.model.transformer import Transformer
from engine.parallel.apply import parallelize
from engine.parallel.memory import estimate_memory, layer_activation_bytes, param_specs
from engine.parallel.mesh import ParallelDims, build_mesh
from engine.parallel.stages import stage_layer_counts, stage_layers
from engine.parallel.tp import loss_context, uses_loss_parallel
from engine.plan import check_config
from engine.precision import cast_weights
from engine.train.losses import build_loss
from engine.train.optim import build_optimizer
from tests.conftest import REPO
from tests.helpers.memory import ACTIVATION_TOLERANCE, job, saved_activation_bytes
from tests.helpers.torchrun import torchrun

MOE = {"num_experts": 4, "moe_top_k": 2, "moe_shared_experts": 1}
SINKS_GATE = {"attention_sinks": True, "attention_output_gate": True, "sdpa_backend": "auto"}  # sinks refuse flash
GPT2 = {"model_type": "gpt2", "n_kv_heads": None, "tie_embeddings": True}  # LayerNorm, biases, learned positions
"""Measured estimate/saved-tensor ratios on CPU (torch 2.13): 1.000 for dense blocks in fp32 and under bf16
autocast (rmsnorm and layernorm, tied or not, either loss, flash or math SDPA) and under tp = 2 (4 bytes
apart), 0.985 (fp32) and 0.962 (bf16) for MoE blocks, 0.965 for QK-norm under bf16, 0.999 for GPT-2 (fp32
and bf16, tied or not, either loss, flash or math SDPA: ~260 bytes apart, about the position lookup's
indices, which the estimate leaves out), 1.000 for the output gate and the sink kernel (fp32 and bf16; with
QK-norm under bf16 0.99)."""


def one_step(cfg: JobConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A real model of the config's family after one optimizer step on random tokens (fp32, one process)."""
    torch.manual_seed(0)
    model = build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.optimizer)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len))
    build_loss(cfg.train)(model, tokens, tokens).backward()
    optimizer.step()
    return model, optimizer


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.nbytes for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("optimizer", ["adamw", "lion", "muon", "schedule_free_adamw"])
@pytest.mark.parametrize(
    "model",
    [
        {},
        {"tie_embeddings": True, "qk_norm": True, "norm_type": "layernorm"},
        MOE,
        {**MOE, "moe_packed_experts": False},
        GPT2,
        {"mtp_depth": 2, "tie_embeddings": True},
    ],
    ids=["dense", "tied-qknorm-ln", "moe", "moe-unpacked", "gpt2", "mtp-tied"],
)
def test_params_grads_and_optimizer_state_equal_what_the_model_holds(model, optimizer):
    scheduler = {"name": "constant", "warmup_steps": 0} if optimizer == "schedule_free_adamw" else {}
    cfg = job(model, optimizer={"name": optimizer}, scheduler=scheduler)
    real, opt = one_step(cfg)
    [stage] = estimate_memory(cfg, 1)
    assert {s.name: s.shape for s in param_specs(cfg.model)} == {n: tuple(p.shape) for n, p in real.named_parameters()}
    assert stage.params == sum(p.nbytes for p in real.parameters())
    assert stage.grads == sum(p.grad.nbytes for p in real.parameters())
    assert stage.optimizer == state_bytes(opt)


def cpu_rmsnorm_extra(cfg: JobConfig) -> int:
    """On CPU torch decomposes RMSNorm and also keeps the normalized input (in its input's dtype); CUDA's fused
    kernel, which the estimate counts, does not. Two norms per block and the final one (fp32 inputs, or bf16
    ones with bf16 weights: 2 bytes more an element, the decomposition's fp32 upcast); per
    multi-token-prediction module over the whole window (Transformer.mtp_outputs), two on fp32 inputs
    (hidden, embedding) and three on its own residual stream, in the compute dtype (its block's two, its
    final norm)."""
    m, t = cfg.model, cfg.train
    # GPT-2's norms are LayerNorm whatever norm_type says (a gpt2 config leaves the field at its default)
    if m.norm_type != "rmsnorm" or m.model_type != "transformer":
        return 0
    compute = 2 if t.mixed_precision == "bf16" else 4
    per_element = 4 + (2 if cfg.optimizer.weight_dtype == "bf16" else 0)
    mtp = m.mtp_depth * t.batch_size * t.seq_len * (2 * 4 + 3 * compute)
    return m.dim * (per_element * t.batch_size * t.seq_len * (2 * m.n_layers + 1) + mtp)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "model,loss",
    [
        ({}, "cross_entropy"),
        ({}, "chunked_cross_entropy"),
        ({"norm_type": "layernorm", "tie_embeddings": True}, "cross_entropy"),
        ({"qk_norm": True}, "cross_entropy"),
        (MOE, "cross_entropy"),
        ({"sdpa_backend": "math"}, "cross_entropy"),
        (GPT2, "cross_entropy"),
        ({**GPT2, "tie_embeddings": False}, "chunked_cross_entropy"),
        ({**GPT2, "sdpa_backend": "math"}, "cross_entropy"),
        ({"attention_head_dim": 24, "attention_qkv_bias": True, "qk_norm": True}, "cross_entropy"),
        ({"sliding_window": 8, "n_kv_heads": 4, "sdpa_backend": "auto"}, "cross_entropy"),
        ({**MOE, "moe_router": "softmax_topk_renorm"}, "cross_entropy"),
        (
            {**MOE, "num_experts": 8, "moe_router": "sigmoid_topk", "moe_n_group": 4, "moe_topk_group": 2},
            "cross_entropy",
        ),
        ({"mtp_depth": 2}, "cross_entropy"),
        ({"mtp_depth": 1, **MOE}, "chunked_cross_entropy"),
        ({"attention_output_gate": True}, "cross_entropy"),
        ({"attention_sinks": True, "sdpa_backend": "auto"}, "cross_entropy"),
        ({**SINKS_GATE, "qk_norm": True}, "cross_entropy"),
        ({**SINKS_GATE, "sliding_window": 8, "n_kv_heads": 4}, "chunked_cross_entropy"),
    ],
    ids=[
        "dense",
        "dense-chunked",
        "layernorm-tied",
        "qknorm",
        "moe",
        "math-sdpa",
        "gpt2",
        "gpt2-untied-chunked",
        "gpt2-math-sdpa",
        "head_dim-bias",
        "window",
        "moe-renorm",
        "moe-grouped",
        "mtp",
        "mtp-moe-chunked",
        "gate",
        "sinks",
        "gate-sinks-qknorm",
        "gate-sinks-window-chunked",
    ],
)
def test_activations_match_the_saved_tensors(model, loss, precision):
    cfg = job({"sdpa_backend": "flash", **model}, train={"mixed_precision": precision, "loss_fn": loss})
    [stage] = estimate_memory(cfg, 1)
    measured = saved_activation_bytes(cfg)
    estimate = stage.activations + cpu_rmsnorm_extra(cfg)
    assert abs(estimate / measured - 1) < ACTIVATION_TOLERANCE, (estimate, measured)


TP_SCRIPT = """
import json, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from engine.config.job import JobConfig
from engine.model.transformer import Transformer
from engine.parallel.expert import shard_experts
from engine.parallel.tp import apply_tensor_parallel, loss_context, uses_loss_parallel
from engine.train.losses import build_loss

dist.init_process_group("gloo")
cfg = JobConfig.model_validate(json.loads(sys.argv[2]))
torch.manual_seed(0)
model = Transformer(cfg.model)
parallel_loss = uses_loss_parallel(2, cfg.train.loss_fn)
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
apply_tensor_parallel(model, mesh, loss_parallel=parallel_loss)
shard_experts(model, None, mesh)  # MoE: the experts' hidden units over tp


def storages(t):
    \"\"\"The storages under a tensor: DTensor (and funcol's async wrapper) hold a plain local tensor.\"\"\"
    if not is_traceable_wrapper_subclass(t):
        return [t.untyped_storage()]
    inner = [getattr(t, name) for name in t.__tensor_flatten__()[0]]
    return [s for i in inner if isinstance(i, torch.Tensor) for s in storages(i)]


state = {s.data_ptr() for t in [*model.parameters(), *model.buffers()] for s in storages(t)}
seen = {}


def pack(t):
    for s in storages(t):
        if s.data_ptr() not in state:
            seen[s.data_ptr()] = s.nbytes()
    return t


tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len),
                       generator=torch.Generator().manual_seed(1))
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), loss_context(parallel_loss):
    loss = build_loss(cfg.train)(model, tokens, tokens.clone())
with open(f"{sys.argv[1]}/rank{dist.get_rank()}.json", "w") as f:
    json.dump(sum(seen.values()), f)
dist.barrier()
dist.destroy_process_group()
from engine.parallel.launch import end_process
end_process(0)  # leave without interpreter teardown while gloo's threads live (see end_process)
"""


@pytest.mark.parametrize("model", [{"mtp_depth": 1}, MOE, SINKS_GATE], ids=["dense-mtp", "moe", "gate-sinks"])
def test_tensor_parallel_activations_match_the_saved_tensors(tmp_path, model):
    """Under TP + sequence parallelism each rank keeps a 1/tp share of everything but the all-gathered inputs
    of the projections and of the head, and of MoE layers, which route all tokens on every rank (checked on
    2 CPU processes, fp32, loss parallel; the dense model with a multi-token-prediction module)."""
    cfg = job({"sdpa_backend": "flash", **model}, distributed={"tp": 2})
    script = tmp_path / "tp.py"
    script.write_text(TP_SCRIPT)
    result = torchrun(script, 2, str(tmp_path), cfg.model_dump_json(), timeout=150)
    assert result.returncode == 0, result.stdout[-3000:]
    [stage] = estimate_memory(cfg, 2)
    estimate = stage.activations + cpu_rmsnorm_extra(cfg) // 2
    for rank in (0, 1):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert abs(estimate / measured - 1) < ACTIVATION_TOLERANCE, (estimate, measured)


def test_fsdp_divides_params_grads_and_optimizer_state():
    (single,) = estimate_memory(job(), 1)
    (sharded,) = estimate_memory(job(distributed={"dp_shard": 8}), 8)
    tensors = len(param_specs(job().model))  # AdamW's scalar `step` is not sharded
    assert sharded.params * 8 == single.params and sharded.grads * 8 == single.grads
    assert (sharded.optimizer - 4 * tensors) * 8 == single.optimizer - 4 * tensors
    assert sharded.activations == single.activations
    # dp_shard = -1 takes what the other degrees leave; HSDP replicas do not shard.
    assert estimate_memory(job(distributed={"dp_replicate": 2}), 16)[0].params == single.params // 8


@contextlib.contextmanager
def fake_ranks(world_size: int):
    """This process as rank 0 of `world_size`, over torch's fake process group: collectives return without
    moving data, while FSDP2 and DTensor lay out every tensor as on a real rank 0 (the fullest: FSDP2 gives the
    first ranks ceil(rows / shards) rows, DTensor's Shard the remainder)."""
    assert not dist.is_initialized()
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def local_bytes(tensors) -> int:
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


@pytest.mark.parametrize(
    "model,layout,world_size",
    [
        ({}, {"dp_shard": 3}, 3),  # rows not divisible by 3: FSDP2 pads
        ({}, {"dp_shard": 8}, 8),
        ({}, {"dp_replicate": 2}, 16),  # HSDP: dp_shard = 8 takes the rest, replicas do not shard
        ({}, {"tp": 2}, 2),
        ({"tie_embeddings": True, "mtp_depth": 1}, {"tp": 2}, 2),
        ({}, {"dp_shard": 2, "tp": 2}, 4),
        ({**MOE, "ffn_hidden_dim": 256}, {"tp": 2}, 2),
    ],
    ids=["fsdp3", "fsdp8", "hsdp", "tp2", "tp2-tied-mtp", "fsdp2-tp2", "moe-tp2"],
)
def test_sharded_params_grads_and_optimizer_state_equal_what_rank_0_holds(model, layout, world_size):
    """The model parallelized as `forge train` does (engine.parallel.apply) after one optimizer step, measured
    on rank 0: its local parameters, gradients and optimizer state in bytes."""
    cfg = check_config(job(model, distributed=layout), world_size)
    with fake_ranks(world_size):
        torch.manual_seed(0)
        mesh = build_mesh(ParallelDims.from_config(cfg.distributed, world_size), "cpu")
        real = parallelize(Transformer(cfg.model), cfg, mesh)
        optimizer = build_optimizer(real, cfg.optimizer)
        tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len))
        with loss_context(uses_loss_parallel(cfg.distributed.tp, cfg.train.loss_fn)):
            build_loss(cfg.train)(real, tokens, tokens).backward()
        optimizer.step()
        parameters = list(real.parameters())
        assert len(parameters) == len(param_specs(cfg.model)) and all(p.grad is not None for p in parameters)
        measured = (
            local_bytes(parameters),
            local_bytes(p.grad for p in parameters),
            local_bytes(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)),
        )
    [stage] = estimate_memory(cfg, world_size)
    assert (stage.params, stage.grads, stage.optimizer) == measured


def test_tensor_parallel_halves_the_sharded_matrices_only():
    m = job().model
    (single,) = estimate_memory(job(), 1)
    (tp,) = estimate_memory(job(distributed={"tp": 2}), 2)
    kv = m.kv_heads * m.head_dim
    block_matrices = 2 * m.dim * m.dim + 2 * kv * m.dim + 3 * m.dim * m.ffn_dim
    split = m.n_layers * block_matrices + 2 * m.vocab_size * m.dim  # + embedding and output head
    assert tp.params == single.params - 4 * split // 2
    assert tp.grads == tp.params + 4 * m.vocab_size * m.dim // 2  # the embedding's gradient is whole (measured above)
    assert tp.activations < single.activations


def test_pipeline_stages_split_the_layers():
    cfg = job({"n_layers": 4}, train={"grad_accum_steps": 4}, distributed={"pp": 2})
    (single,) = estimate_memory(job({"n_layers": 4}), 1)
    first, last = estimate_memory(cfg, 2)
    assert (first.blocks, last.blocks) == (((0, 1),), ((2, 3),))
    assert first.params + last.params == single.params == 4 * param_counts(cfg.model)["total"]
    assert last.params - first.params == 4 * cfg.model.dim  # embedding + 2 blocks vs 2 blocks + norm + head
    assert (first.microbatches_in_flight, last.microbatches_in_flight) == (2, 1)  # 1F1B warm-up depth
    gpipe = estimate_memory(
        cfg.model_copy(update={"distributed": cfg.distributed.model_copy(update={"pp_schedule": "gpipe"})}), 2
    )
    assert [r.microbatches_in_flight for r in gpipe] == [4, 4]


def test_interleaved_ranks_hold_two_stages():
    cfg = job({"n_layers": 8}, train={"grad_accum_steps": 4}, distributed={"pp": 2, "pp_schedule": "interleaved_1f1b"})
    first, last = estimate_memory(cfg, 2)
    assert (first.stages, last.stages) == ((0, 2), (1, 3))
    assert (first.blocks, last.blocks) == (((0, 1), (4, 5)), ((2, 3), (6, 7)))
    assert (first.microbatches_in_flight, last.microbatches_in_flight) == (5, 3)  # torch's warm-up + 1
    assert first.params + last.params == 4 * param_counts(cfg.model)["total"]


@pytest.mark.parametrize(
    "n_layers,n_stages", [(n, s) for n in (1, 2, 3, 4, 5, 8, 13, 80) for s in (1, 2, 3, 4, 8) if s <= n]
)
def test_stage_split_covers_every_layer_once_in_order(n_layers, n_stages):
    """The blocks of the stages, one after the other, are the model's blocks in order, each stage at least one,
    and no stage costs more than one block above the cheapest (first and last also hold embedding / head)."""
    layers, counts = stage_layers(n_layers, n_stages), stage_layer_counts(n_layers, n_stages)
    assert len(layers) == n_stages and [len(r) for r in layers] == counts and min(counts) >= 1
    assert [i for r in layers for i in r] == list(range(n_layers))
    costs = [c + (s == 0) + (s == n_stages - 1) for s, c in enumerate(counts)]
    assert max(costs) - min(costs) <= 1 or min(counts) == 1


def test_gradients_and_activations_add_up_only_when_gradients_persist():
    (one,) = estimate_memory(job(), 1)
    (accumulating,) = estimate_memory(job(train={"grad_accum_steps": 2}), 1)
    assert one.total == one.params + one.optimizer + one.buffers + max(one.grads, one.activations)
    assert accumulating.total == one.total + min(one.grads, one.activations)


def test_activation_checkpointing_keeps_less():
    (none,) = estimate_memory(job({"n_layers": 4}), 1)
    (full,) = estimate_memory(job({"n_layers": 4}, train={"activation_checkpointing": "full"}), 1)
    assert full.activations < none.activations
    (double,) = estimate_memory(job({"n_layers": 4}, train={"batch_size": 4}), 1)
    assert double.activations == 2 * none.activations


LLAMA_70B = [
    "--model.dim=8192",
    "--model.n_layers=80",
    "--model.n_heads=64",
    "--model.n_kv_heads=8",
    "--model.vocab_size=128256",
    "--model.ffn_hidden_dim=28672",
    "--model.max_seq_len=8192",
    "--train.seq_len=4096",
    "--train.batch_size=1",
    "--train.mixed_precision=bf16",
    "--train.activation_checkpointing=full",
]


class TensorOps(TorchDispatchMode):
    """Counts the tensor operations torch runs while it is active, on any device (meta included)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_70b_estimate_is_arithmetic_on_the_config():
    """ "Instant" as a count, not a clock a loaded machine moves: the estimate runs no tensor operation, not
    even on the meta device, so it never builds the model (the 70B's sizes stay Python ints)."""
    cfg = JobConfig(
        model={
            "dim": 8192,
            "n_layers": 80,
            "n_heads": 64,
            "n_kv_heads": 8,
            "vocab_size": 128256,
            "ffn_hidden_dim": 28672,
            "max_seq_len": 8192,
        },
        train={"seq_len": 4096, "batch_size": 1},
    )
    with TensorOps() as counted:
        (stage,) = estimate_memory(cfg, 32)
    assert counted.ops == []
    with TensorOps() as counted:
        torch.ones(2).add_(1)  # the counter sees tensor work when there is some
    assert counted.ops == ["aten.ones.default", "aten.add_.Tensor"]
    total = param_counts(cfg.model)["total"]
    assert 70.5e9 < total < 70.6e9 and stage.params * 32 == 4 * total  # every row count divides by 32


def forge(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "forgecli.app", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_cli_prints_the_estimate_for_32_ranks():
    result = forge("validate-config", "presets/debug.toml", *LLAMA_70B, "--world-size", "32", "--gpu-memory-gib", "80")
    assert result.returncode == 0, result.stderr
    assert "Estimated memory per rank, GiB (dp_replicate=1 × dp_shard=32 × tp=1 × pp=1 × cp=1 = 32)" in result.stdout
    assert "fits 80 GiB" in result.stdout and "yes" in result.stdout


def test_cli_prints_the_estimate_with_tensor_parallelism():
    """tp = 8 under 32 ranks leaves dp_shard = 4: tensor parallelism splits every block matrix, the embedding
    and the head 8 ways and FSDP 4 ways (1/32 of their fp32 bytes per rank), while the norms' weights are
    replicated across tp and only FSDP-sharded (1/4 of theirs)."""
    layout = ("validate-config", "presets/debug.toml", *LLAMA_70B, "--world-size", "32", "--distributed.tp=8")
    result = forge(*layout)
    assert result.returncode == 0, result.stderr
    assert "dp_shard=4 × tp=8" in result.stdout
    shown = forge(*layout, "--json")
    assert shown.returncode == 0, shown.stderr
    [stage] = json.loads(shown.stdout)["memory"]["stages"]
    cfg = load_job_config(REPO / "presets" / "debug.toml", [arg.removeprefix("--") for arg in LLAMA_70B])
    norms = (2 * cfg.model.n_layers + 1) * cfg.model.dim
    assert stage["params"] == 4 * (param_counts(cfg.model)["total"] - norms) // 32 + 4 * norms // 4


def test_cli_bad_layout_exits_2_naming_the_degrees():
    result = forge(
        "validate-config",
        "presets/debug.toml",
        *LLAMA_70B,
        "--world-size",
        "32",
        "--distributed.tp=8",
        "--distributed.dp_shard=3",
    )
    assert result.returncode == 2
    assert "dp_shard=3" in result.stderr and "tp=8" in result.stderr and "world size 32" in result.stderr
    assert "Traceback" not in result.stderr and "Estimated memory" not in result.stdout


def test_cli_json_has_the_stages():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "forgecli.app",
            "validate-config",
            "presets/debug.toml",
            "--json",
            "--world-size",
            "4",
            "--gpu-memory-gib",
            "0.01",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    memory = json.loads(result.stdout)["memory"]
    [stage] = memory["stages"]
    assert not stage["grads_persist"]  # one micro-batch: backward trades activations for gradients
    assert stage["total"] == (
        stage["params"] + stage["optimizer"] + stage["buffers"] + max(stage["grads"], stage["activations"])
    )
    assert memory["gpu_memory_gib"] == 0.01 and memory["fits"] is False


def test_tensor_parallel_splits_the_experts_hidden_units_not_the_router():
    """MoE under tp (engine/parallel/tp.py, expert.py): routed and shared experts split over their hidden
    units, the router gate replicated; every rank routes all of the layer's tokens."""
    moe = {**MOE, "ffn_hidden_dim": 256}
    (single,) = estimate_memory(job(moe), 1)
    (tp,) = estimate_memory(job(moe, distributed={"tp": 2}), 2)
    m = job(moe).model
    kv, h = m.kv_heads * m.head_dim, m.expert_ffn_dim
    experts = 3 * m.num_experts * m.dim * h + 3 * m.dim * h  # routed + one shared
    split = m.n_layers * (2 * m.dim * m.dim + 2 * kv * m.dim + experts) + 2 * m.vocab_size * m.dim
    assert tp.params == single.params - 4 * split // 2


def test_expert_parallelism_with_compile_is_estimated_like_eager():
    """ep = 2 with compile validates, and its estimate is the eager one: the MoE blocks compile in regions
    around the routed experts, whose activations and exchanged rows are those the eager count already holds
    (a compiled region saves no more than eager). Against plain data parallelism over the same 4 ranks, each
    rank holds the same share of the experts' weights (4 experts ÷ 2 ep ranks, FSDP over the 2 holding them)."""
    layout = {"dp_shard": 4, "ep": 2}
    compiled = check_config(job(MOE, train={"compile_model": True}, distributed=layout), 4)
    assert estimate_memory(compiled, 4) == estimate_memory(job(MOE, distributed=layout), 4)
    (data_parallel,) = estimate_memory(job(MOE, distributed={"dp_shard": 4}), 4)
    assert estimate_memory(compiled, 4)[0].params == data_parallel.params


def test_int8_adamw_state_equals_what_torchao_holds(monkeypatch):
    """optimizer.state_dtype = "int8": the codes, block scales and tables of torchao's AdamW8bit for the tensors
    of ≥ 4096 elements, fp32 moments for the rest, a step tensor each, byte for byte (its step run eagerly:
    tests/train/test_memory_options.py says why)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    cfg = job(optimizer={"state_dtype": "int8"})
    _, opt = one_step(cfg)
    [stage] = estimate_memory(cfg, 1)
    inner = [
        getattr(v, name) if is_traceable_wrapper_subclass(v) else v
        for state in opt.state.values()
        for v in state.values()
        for name in (v.__tensor_flatten__()[0] if is_traceable_wrapper_subclass(v) else [None])
    ]
    assert any(is_traceable_wrapper_subclass(v) for state in opt.state.values() for v in state.values())
    assert stage.optimizer == sum(t.nbytes for t in inner)
    (fp32,) = estimate_memory(job(), 1)
    assert stage.optimizer < fp32.optimizer / 2


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_offloaded_activations_match_the_saved_tensors(checkpointing):
    """train.activation_offload: what the saved-tensor hooks receive (save_on_cpu's, which copy each to the
    host), checkpointed blocks' inputs included, against the estimate's host bytes; the device keeps one
    block's recomputation."""
    cfg = job({"sdpa_backend": "flash"}, train={"activation_checkpointing": checkpointing, "activation_offload": True})
    [stage] = estimate_memory(cfg, 1)
    [kept] = estimate_memory(job({"sdpa_backend": "flash"}, train={"activation_checkpointing": checkpointing}), 1)
    measured = saved_activation_bytes(cfg)
    norms = cpu_rmsnorm_extra(cfg) if checkpointing == "none" else 4 * cfg.model.dim * 64  # the final norm's only
    assert abs((stage.host + norms) / measured - 1) < ACTIVATION_TOLERANCE, (stage.host, measured)
    per_block = max(layer_activation_bytes(cfg, layer, 64) for layer in range(cfg.model.n_layers))
    assert stage.activations == per_block < kept.activations


@pytest.mark.parametrize("state", ["bf16", "int8"])
def test_bf16_weights_params_grads_and_state_equal_what_the_model_holds(monkeypatch, state):
    """optimizer.weight_dtype = "bf16": bf16 weights and gradients, torchao's moments in bf16 (or 8-bit codes for
    the large tensors), an fp32 step each, byte for byte; and the saved activations of a bf16 residual stream
    with no autocast copies of the weights."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    cfg = job(optimizer={"weight_dtype": "bf16", "state_dtype": state}, train={"mixed_precision": "bf16"})
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    cast_weights(model, torch.bfloat16)
    optimizer = build_optimizer(model, cfg.optimizer)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len))
    with torch.autocast("cpu", torch.bfloat16):
        build_loss(cfg.train)(model, tokens, tokens).backward()
    optimizer.step()
    [stage] = estimate_memory(cfg, 1)
    assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()} == {torch.bfloat16}
    assert stage.params == sum(p.nbytes for p in model.parameters())
    assert stage.grads == sum(p.grad.nbytes for p in model.parameters())
    inner = [
        getattr(v, name) if is_traceable_wrapper_subclass(v) else v
        for values in optimizer.state.values()
        for v in values.values()
        for name in (v.__tensor_flatten__()[0] if is_traceable_wrapper_subclass(v) else [None])
    ]
    assert stage.optimizer == sum(t.nbytes for t in inner)
    measured = saved_activation_bytes(cfg)
    assert abs((stage.activations + cpu_rmsnorm_extra(cfg)) / measured - 1) < ACTIVATION_TOLERANCE, measured
