"""Step time, peak memory and losses of activation checkpointing (none/full/selective, eager and compiled)
and of FP8 (bf16 vs torchao tensorwise/rowwise, eager and compiled) on one GPU; plus FP8 under FSDP2 with
and without the float8 all-gather (one rank). Results: benchmarks/results/gpu_h100_parallel.md.

  python benchmarks/gpu_ac_fp8.py ac fp8 fsdp compile     # any subset of the four sections
"""

import os
import sys
import time

import torch
import torchao

from engine.config.model import ModelConfig
from engine.config.train import TrainConfig
from engine.model import build_model
from engine.parallel.activation_checkpoint import apply_activation_checkpointing
from engine.parallel.float8 import convert_to_float8
from engine.train.balancing import attach_router_balancing
from engine.train.losses import build_loss

dev = torch.device("cuda")
print(
    "torch",
    torch.__version__,
    "torchao",
    torchao.__version__,
    torch.cuda.get_device_name(),
    torch.cuda.get_device_capability(),
)
loss_fn = build_loss(TrainConfig())
which = sys.argv[1:]


def build(fields, fp8=None, ac="none", fsdp_ag=False):
    torch.manual_seed(0)
    m = build_model(ModelConfig(**fields)).to(dev)
    if fp8:
        convert_to_float8(m, fp8, fsdp_float8_all_gather=fsdp_ag)
    apply_activation_checkpointing(m, ac)
    attach_router_balancing(m)  # the sigmoid router's balancing bias, as the trainer updates it
    return m


def run(m, fields, batch, seq, steps, lr=3e-4, after_step=None, timed_from=3):
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    g = torch.Generator(device="cpu").manual_seed(0)
    data = [torch.randint(0, fields["vocab_size"], (batch, seq + 1), generator=g).to(dev) for _ in range(2)]
    losses = []
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    for s in range(steps):
        if s == timed_from:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        b = data[s % 2]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(m, b[:, :-1], b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step:
            after_step(m)
        losses.append(loss.item())
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / (steps - timed_from)
    return losses, dt, torch.cuda.max_memory_allocated() / 2**30


def compare_ac(label, fields, batch, seq):
    """Step time, peak memory and losses of the three checkpointing modes on the same model and batches."""
    res = {}
    for mode in ["none", "full", "selective"]:
        m = build(fields, ac=mode)
        l, dt, mem = run(m, fields, batch, seq, 8)
        res[mode] = l
        print(
            f"{label} {mode:9s} step {dt * 1e3:7.1f} ms  tok/s {batch * seq / dt:9.0f}  peak {mem:6.2f} GiB  "
            f"loss {l[0]:.4f}->{l[-1]:.4f}",
            flush=True,
        )
        del m
        torch.cuda.empty_cache()
    for mode in ["full", "selective"]:
        print(f"{label} max|loss - none|", mode, max(abs(a - b) for a, b in zip(res[mode], res["none"])))


if "ac" in which:
    F = dict(dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, vocab_size=8192, max_seq_len=2048)
    compare_ac("AC", F, 8, 2048)
    FM = dict(
        F,
        n_layers=4,
        num_experts=8,
        moe_top_k=2,
        moe_router="sigmoid_topk",
        moe_shared_experts=1,
        moe_expert_ffn_multiplier=0.5,
        moe_aux_loss_weight=0.001,
        moe_bias_schedule=[(0, 0.01)],
    )
    compare_ac("AC-MoE", FM, 8, 1024)

if "fp8" in which:
    for F, batch, seq, steps in [
        (dict(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=4096, max_seq_len=512), 8, 512, 60),
        (dict(dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, vocab_size=8192, max_seq_len=2048), 4, 2048, 10),
    ]:
        base = None
        for recipe in [None, "tensorwise", "rowwise"]:
            m = build(F, fp8=recipe)
            l, dt, mem = run(m, F, batch, seq, steps)
            if base is None:
                base = l
            dev_ = max(abs(a - b) for a, b in zip(l, base))
            print(
                f"FP8 dim {F['dim']} {recipe or 'bf16':10s} step {dt * 1e3:7.1f} ms tok/s {batch * seq / dt:9.0f} peak {mem:6.2f} GiB loss {l[0]:.4f}->{l[-1]:.4f} max|Δ vs bf16| {dev_:.4f}",
                flush=True,
            )
            del m
            torch.cuda.empty_cache()

if "fsdp" in which:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    F = dict(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=4096, max_seq_len=512)
    out = {}
    for ag in [False, True]:
        m = build(F, fp8="tensorwise", fsdp_ag=ag)
        for block in m.layers.values():
            fully_shard(block)
        fully_shard(m)
        l, dt, mem = run(m, F, 8, 512, 10, after_step=precompute_float8_dynamic_scale_for_fsdp if ag else None)
        out[ag] = l
        print(f"FSDP fp8 all-gather={ag}: loss {l[0]:.4f}->{l[-1]:.4f}")
    print("FSDP max|Δ| float8 all-gather vs bf16 all-gather", max(abs(a - b) for a, b in zip(out[True], out[False])))
    dist.destroy_process_group()

if "compile" in which:
    from engine.parallel.apply import apply_compile

    F = dict(dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, vocab_size=8192, max_seq_len=2048)
    for mode in ["none", "full", "selective"]:
        torch._dynamo.reset()
        m = build(F, ac=mode)
        apply_compile(m)
        t = time.perf_counter()
        l, dt, mem = run(m, F, 8, 2048, 8)
        print(
            f"compiled AC {mode:9s} step {dt * 1e3:7.1f} ms  tok/s {8 * 2048 / dt:9.0f}  peak {mem:6.2f} GiB  loss {l[0]:.4f}->{l[-1]:.4f} (total {time.perf_counter() - t:.0f} s)",
            flush=True,
        )
        del m
        torch.cuda.empty_cache()
    F = dict(dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, vocab_size=8192, max_seq_len=2048)
    for recipe in [None, "tensorwise", "rowwise"]:
        torch._dynamo.reset()
        m = build(F, fp8=recipe)
        apply_compile(m)
        l, dt, mem = run(m, F, 4, 2048, 10)
        print(
            f"compiled FP8 dim 4096 {recipe or 'bf16':10s} step {dt * 1e3:7.1f} ms tok/s {4 * 2048 / dt:9.0f} peak {mem:6.2f} GiB loss {l[0]:.4f}->{l[-1]:.4f}",
            flush=True,
        )
        del m
        torch.cuda.empty_cache()
