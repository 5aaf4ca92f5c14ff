"""Step time of every optimizer relative to AdamW on the same model, batch and thread count.

For each optimizer: the median time of `optimizer.step()` alone, and of a whole training step (forward,
cross-entropy, backward, gradient clipping, optimizer step). Optimizers are timed in alternating rounds
(adamw, lion, muon, schedule-free, adamw, …) so that drift of a shared machine hits all alike.

    python benchmarks/bench_optimizers.py                          # the debug preset's model, CPU, fp32
    python benchmarks/bench_optimizers.py --dim 512 --n-layers 8 --n-heads 8 --n-kv-heads 8 --vocab-size 8192
    python benchmarks/bench_optimizers.py --device cuda --dtype bf16 --dim 2048 --n-layers 16 --seq-len 2048
"""

from __future__ import annotations

import platform
import statistics
import time

import torch
from bench_args import emit, model_config, model_parser

from engine.config.model import ModelConfig
from engine.config.optimizer import OptimizerConfig
from engine.model import build_model
from engine.precision import COMPUTE_DTYPES, autocast
from engine.train.losses import cross_entropy
from engine.train.optim import build_optimizer

OPTIMIZERS = ("adamw", "lion", "muon", "schedule_free_adamw")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Timed:
    """One optimizer on its own copy of the model, with its step times."""

    def __init__(self, name: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        torch.manual_seed(0)
        self.model = build_model(cfg).to(device)
        self.optimizer = build_optimizer(self.model, OptimizerConfig(name=name, lr=1e-3))
        self.device, self.dtype = device, dtype
        self.step_times: list[float] = []
        self.optimizer_times: list[float] = []

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, record: bool) -> None:
        synchronize(self.device)
        start = time.perf_counter()
        with autocast(self.device, self.dtype):
            loss = cross_entropy(self.model(inputs), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        synchronize(self.device)
        before_optimizer = time.perf_counter()
        self.optimizer.step()
        synchronize(self.device)
        end = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        if record:
            self.step_times.append(end - start)
            self.optimizer_times.append(end - before_optimizer)


def main() -> None:
    args = model_parser(__doc__, batch_size=8, warmup=2, steps=4).parse_args()

    device, dtype = torch.device(args.device), COMPUTE_DTYPES[args.dtype]
    cfg = model_config(args)
    tokens = torch.randint(
        0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=torch.Generator().manual_seed(1)
    ).to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    runs = {name: Timed(name, cfg, device, dtype) for name in OPTIMIZERS}
    for run in runs.values():
        for _ in range(args.warmup):
            run.step(inputs, labels, record=False)
    for _ in range(args.rounds):
        for run in runs.values():
            for _ in range(args.steps):
                run.step(inputs, labels, record=True)

    base = runs["adamw"]
    report = {
        "setup": {
            **vars(args),
            "parameters": sum(p.numel() for p in base.model.parameters()),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
            "device_name": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        },
        **{
            name: {
                "median_step_ms": 1e3 * statistics.median(run.step_times),
                "median_optimizer_step_ms": 1e3 * statistics.median(run.optimizer_times),
                "step_time_vs_adamw": statistics.median(run.step_times) / statistics.median(base.step_times),
                "optimizer_time_vs_adamw": statistics.median(run.optimizer_times)
                / statistics.median(base.optimizer_times),
            }
            for name, run in runs.items()
        },
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
