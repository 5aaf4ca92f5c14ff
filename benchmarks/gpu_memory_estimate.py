"""Peak CUDA memory of real training steps against `engine.parallel.memory.estimate_memory` (what
`forge validate-config --world-size` prints), on one GPU, for several precisions, checkpointing modes,
optimizers and model variants. Results: benchmarks/results/gpu_h100_parallel.md.

  OUT=/tmp/memcheck python benchmarks/gpu_memory_estimate.py    # rows.jsonl and gpu_peak.json under $OUT
"""

import json
import os

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from engine import precision
from engine.config.job import JobConfig
from engine.model import build_model
from engine.parallel.memory import estimate_memory
from engine.train.losses import build_loss
from engine.train.optim import build_optimizer

MODEL = dict(dim=2048, n_layers=8, n_heads=16, n_kv_heads=4, vocab_size=32000, max_seq_len=2048)
GIB = 2**30


def fsdp(net, dtype):
    """What engine.parallel.apply.apply_fsdp does, on a 1-rank mesh (all-gathers in bf16, no autocast)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cuda", (1,))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    blocks = list(net.layers.values())
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(net, mesh=mesh, mp_policy=policy, reshard_after_forward=True)


def run(mp, ac="none", loss_fn="cross_entropy", opt="adamw", accum=1, model=None, batch=4, seq=2048, sharded=False):
    # sharded: FSDP2 on one rank; estimated as HSDP dp_replicate=2 × dp_shard=1 (FSDP applied, nothing sharded)
    cfg = JobConfig(
        model={**MODEL, **(model or {})},
        train=dict(
            batch_size=batch,
            seq_len=seq,
            mixed_precision=mp,
            activation_checkpointing=ac,
            loss_fn=loss_fn,
            grad_accum_steps=accum,
        ),
        optimizer=dict(name=opt),
        distributed=dict(dp_replicate=2, dp_shard=1) if sharded else {},
    )
    torch.cuda.empty_cache()
    dev = torch.device("cuda")
    net = build_model(cfg.model).to(dev)
    if ac == "full":
        for name, block in net.layers.named_children():
            net.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
    dtype = precision.compute_dtype(mp, dev)
    if sharded:
        fsdp(net, dtype)
    optimizer = build_optimizer(net, cfg.optimizer)
    loss = build_loss(cfg.train)
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, seq), device=dev)
    for step in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for micro in range(accum):
            with precision.autocast(dev, torch.float32 if sharded else dtype):
                value = loss(net, tokens, tokens) / accum
            if micro == 0:
                forward = torch.cuda.memory_allocated() - base
            value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    est = estimate_memory(cfg, 2 if sharded else 1)[0]
    row = dict(
        sharded=sharded,
        mp=mp,
        ac=ac,
        loss=loss_fn,
        opt=opt,
        accum=accum,
        model=model or {},
        peak=round(peak / GIB, 3),
        states=round(base / GIB, 3),
        est_states=round((est.params + est.optimizer) / GIB, 3),
        forward=round(forward / GIB, 3),
        est_act=round(est.activations / GIB, 3),
        est_buf=round(est.buffers / GIB, 3),
        est_total=round(est.total / GIB, 3),
        ratio=round(est.total / peak, 3),
    )
    print(json.dumps(row), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "rows.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    del net, optimizer
    return row


import torch.distributed as dist

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511", RANK="0", WORLD_SIZE="1")
dist.init_process_group("nccl")
torch.cuda.set_device(0)
rows = [
    run("bf16"),
    run("bf16", ac="full"),
    run("fp32"),
    run("fp32", model={"n_kv_heads": 16}),
    run("bf16", accum=2),
    run("bf16", opt="muon"),
    run("bf16", model={"qk_norm": True}),
    run("bf16", model={"num_experts": 8, "moe_top_k": 2, "moe_shared_experts": 1, "moe_expert_ffn_multiplier": 0.5}),
]
json.dump(
    {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": rows},
    open(os.path.join(os.environ.get("OUT", "."), "gpu_peak.json"), "w"),
    indent=1,
)
