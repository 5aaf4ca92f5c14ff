"""Forge vs torchtitan: the same Llama shape trained on the same device, in one job, per precision mode.

Both sides train the shape of a Forge preset (default presets/1b.toml, Llama 3.2 1B) at the same batch,
sequence length, precision, activation checkpointing (none) and compile setting, with AdamW and next-token
cross-entropy on the same random tokens, on one device without sharding:

- Forge: `engine.model.build_model` + `engine.parallel.apply.parallelize` (what `forge train` applies on
  one device: float8 conversion, per-block compile) + Forge's loss (`train.loss_fn` of the preset) and
  optimizer, under Forge's autocast.
- torchtitan (PyPI `torchtitan`): its own Llama 3 model (`torchtitan.models.llama3.Llama3Model`, fused
  QKV, its RMSNorm/SwiGLU/complex RoPE), built for the same shape with SDPA as its inner attention (the
  kernel Forge uses, so the race measures the framework, not the attention kernel; torchtitan's language
  models default to FlexAttention, which has no CPU backward), float8 by torchao's
  `convert_to_float8_training` with the same filter, per-block `torch.compile` as torchtitan's
  `apply_compile` does, the same autocast, `torch.optim.AdamW` (fused on CUDA) and plain cross-entropy.
  Its training loop is this script's, not torchtitan's `Trainer` (which needs its config system, a
  tokenizer and a dataset); the model, its kernels and its float8/compile recipe are torchtitan's.

Modes: bf16, bf16+compile, fp8+compile (any of them with --modes). Per mode and side: the median time of the
timed steps after warm-up and the tokens/s it gives, MFU (Forge's FLOPs/token over the device's peak,
engine.metrics.mfu: the same count for both sides), peak memory (torch.cuda.max_memory_allocated; on CPU the process's peak RSS,
which only grows, so it is not comparable across sides there). Sides run one after another per mode, each
freed before the next is built, in alternating order across modes.

    python benchmarks/gpu_race.py --device cuda --out race_1b.json                         # one H100
    python benchmarks/gpu_race.py --device cuda --seq-len 8192 --batch-size 1 --out race_1b_8k.json
    python benchmarks/gpu_race.py --device cpu --toy --modes bf16 --steps 2 --warmup 1     # the suite's check

Both sides keep fp32 weights, gradients and AdamW state on the one device (16 bytes a parameter), so the
1B preset (1.24B parameters, ~20 GB) fits an H100 and the 8B one (~128 GB before activations) does not:
an 8B race needs FSDP over several GPUs, which this one-device script does not set up.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.config.job import JobConfig
from engine.config.loader import load_job_config
from engine.metrics.memory import memory_stats
from engine.metrics.mfu import mfu, peak_flops
from engine.model import build_model
from engine.model.estimate import param_counts, training_flops_per_token
from engine.parallel.apply import parallelize
from engine.parallel.float8 import float8_filter, quiet_torchao_import
from engine.precision import autocast
from engine.train.losses import build_loss
from engine.train.optim import build_optimizer

MODES = {"bf16": ("bf16", False), "bf16+compile": ("bf16", True), "fp8+compile": ("fp8", True)}
TOY = [
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.vocab_size=256",
    "--model.ffn_hidden_dim=192",
    "--model.max_seq_len=64",
    "--model.tie_embeddings=false",
]


@dataclass
class Side:
    """One framework's model ready to train: `step()` runs one optimizer step and returns the loss."""

    name: str
    model: nn.Module
    step: Callable[[], float]


def job_config(args: argparse.Namespace, mode: str) -> JobConfig:
    precision, compile_model = MODES[mode]
    overrides = [
        f"--train.mixed_precision={precision}",
        f"--train.compile_model={str(compile_model).lower()}",
        "--train.activation_checkpointing=none",
        f"--train.seq_len={args.seq_len}",
        f"--train.batch_size={args.batch_size}",
        *(TOY if args.toy else []),
    ]
    return load_job_config(args.preset, overrides)


def forge_side(cfg: JobConfig, device: torch.device, batch: tuple[torch.Tensor, torch.Tensor]) -> Side:
    torch.manual_seed(0)
    model = parallelize(build_model(cfg.model).to(device), cfg, device=device)
    optimizer, loss_of = build_optimizer(model, cfg.optimizer), build_loss(cfg.train)
    return Side("forge", model, train_step(model, optimizer, lambda: loss_of(model, *batch), device))


def torchtitan_importable() -> None:
    """torchtitan 0.3.0 imports `torch.distributed.fsdp.DataParallelMeshDims` at package import, which torch
    2.11 (the lent GPU machine's) lacks. This one-device race never calls the FSDP helpers that use it, so a
    placeholder class there lets the model package load, its model code untouched; newer torch has the name."""
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {})


def titan_model(cfg: JobConfig) -> nn.Module:
    """torchtitan's Llama 3 at Forge's shape, SDPA inside (see the module docstring)."""
    torchtitan_importable()
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    m = cfg.model
    layers = _build_llama3_layers(
        n_layers=m.n_layers,
        dim=m.dim,
        n_heads=m.n_heads,
        n_kv_heads=m.kv_heads,
        hidden_dim=m.ffn_dim,
        rope=ComplexRoPE.Config(dim=m.head_dim, max_seq_len=m.max_seq_len, theta=m.rope_theta),
        attn_backend="flex",  # replaced below: the builder accepts only flex/varlen names
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = Llama3Model.Config(
        dim=m.dim,
        vocab_size=m.vocab_size,
        enable_weight_tying=m.tie_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=m.vocab_size, embedding_dim=m.dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=m.dim, eps=m.norm_eps, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=m.dim, out_features=m.vocab_size, param_init=_output_linear_init(m.dim)),
        layers=layers,
    )
    model = config.build()
    model.init_states()
    return model


def titan_side(cfg: JobConfig, device: torch.device, batch: tuple[torch.Tensor, torch.Tensor]) -> Side:
    torch.manual_seed(0)
    with torch.device(device):
        model = titan_model(cfg)
    if cfg.train.mixed_precision == "fp8":
        with quiet_torchao_import():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(cfg.train.fp8_recipe)
        titan_filter = lambda module, fqn: fqn != "lm_head" and float8_filter(module, fqn)  # noqa: E731
        convert_to_float8_training(model, config=config, module_filter_fn=titan_filter)
    if cfg.train.compile_model:
        for block in model.layers.values():
            block.compile(fullgraph=True)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.optimizer.lr, betas=tuple(cfg.optimizer.betas), fused=device.type == "cuda"
    )
    inputs, labels = batch
    positions = torch.arange(inputs.shape[1], device=device).expand_as(inputs)

    def loss() -> torch.Tensor:
        logits = model(inputs, positions)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    return Side("torchtitan", model, train_step(model, optimizer, loss, device))


def train_step(model: nn.Module, optimizer, loss_of: Callable[[], torch.Tensor], device) -> Callable[[], float]:
    def step() -> float:
        loss = loss_of()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()  # synchronizes

    return step


def run_side(build: Callable[[], Side], cfg: JobConfig, device: torch.device, args) -> dict:
    """Build, warm up (compiles), time `args.steps` steps; the side is freed before returning."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    side = build()
    dtype = torch.bfloat16
    losses, times = [], []
    with autocast(device, dtype):
        for i in range(args.warmup + args.steps):
            start = time.perf_counter()
            losses.append(side.step())
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
    median_step_sec = statistics.median(times)
    tokens_per_sec = args.batch_size * args.seq_len / median_step_sec
    flops_per_token = training_flops_per_token(cfg.model, args.seq_len)
    result = {
        "parameters": sum(p.numel() for p in {id(p): p for p in side.model.parameters()}.values()),
        "median_step_sec": median_step_sec,
        "tokens_per_sec": tokens_per_sec,
        "mfu": mfu(flops_per_token, tokens_per_sec, peak_flops(device, dtype)),
        "peak_memory_gib": memory_stats(device)["mem_peak_gib"],
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
    del side
    gc.collect()
    return result


def race(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    results: dict = {}
    for index, mode in enumerate(args.modes):
        cfg = job_config(args, mode)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.model.vocab_size, (args.batch_size, args.seq_len + 1), generator=g).to(device)
        batch = (tokens[:, :-1], tokens[:, 1:])
        builders = {
            "forge": lambda cfg=cfg, batch=batch: forge_side(cfg, device, batch),
            "torchtitan": lambda cfg=cfg, batch=batch: titan_side(cfg, device, batch),
        }
        order = list(builders) if index % 2 == 0 else list(reversed(builders))
        runs = {name: run_side(builders[name], cfg, device, args) for name in order}
        runs["forge_over_torchtitan_tokens_per_sec"] = (
            runs["forge"]["tokens_per_sec"] / runs["torchtitan"]["tokens_per_sec"]
        )
        runs["expected_parameters"] = param_counts(cfg.model)["total"]
        results[mode] = runs
    return results


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="presets/1b.toml", help="the Forge preset whose model shape both train")
    p.add_argument("--toy", action="store_true", help="shrink the model to a toy (dim 64, 2 layers) for CPU checks")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument(
        "--modes", type=lambda s: s.split(","), default=list(MODES), help="comma-separated: " + ", ".join(MODES)
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", help="write the JSON report here too")
    args = p.parse_args(argv)
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    torchtitan_importable()
    import torchtitan

    report = {
        "results": race(args),
        "setup": {
            **vars(args),
            "torch": torch.__version__,
            "torchtitan": getattr(torchtitan, "__version__", "unknown"),
            "python": platform.python_version(),
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        },
    }
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
