"""μP learning-rate transfer: the best learning rate per width (AdamW, or Muon), under sp and under mup.

For each width and parametrization, the same 2-layer model shape (head size fixed at 32, FFN width 2·dim)
trains on the same tokens of the embedded Shakespeare corpus (same seed, same batches: steps × batch × seq
tokens) at each learning rate of the grid (linear warmup, then cosine to 10 %), and is scored by its mean
cross-entropy on fixed held-out batches (Hamlet, The Tempest). μP's base width is the narrowest one, so at
that width the two parametrizations differ only in the attention scale. The claim under test (Yang et al.
2022): under mup the best learning rate stays put as the model widens; under sp it moves down.

    python benchmarks/bench_mup_transfer.py --out benchmarks/results/mup_transfer.json
    python benchmarks/bench_mup_transfer.py --widths 64 128 --lrs 3e-3 1e-2 --steps 20   # a quick look
    python benchmarks/bench_mup_transfer.py --from-json benchmarks/results/mup_transfer.json   # the tables

Under Muon (`--optimizer muon`: its hidden matrices at lr, the rest on its AdamW fallback at the same lr) the
two parametrizations can run side by side, one process each, and their reports merge into one table:

    python benchmarks/bench_mup_transfer.py --optimizer muon --parametrizations sp --out /tmp/sp.json &
    python benchmarks/bench_mup_transfer.py --optimizer muon --parametrizations mup --out /tmp/mup.json
    python benchmarks/bench_mup_transfer.py --from-json /tmp/sp.json /tmp/mup.json \
        --out benchmarks/results/mup_transfer_muon.json --md benchmarks/results/mup_transfer_muon.md
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import time

import numpy as np
import torch

from engine.config.model import ModelConfig
from engine.config.optimizer import OptimizerConfig
from engine.data.embedded import embedded_corpus
from engine.data.shards import open_shard, read_manifest
from engine.model import build_model
from engine.train.losses import cross_entropy
from engine.train.optim import build_optimizer


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--lrs", type=float, nargs="+", default=[3.2e-4, 1e-3, 3.2e-3, 1e-2, 3.2e-2])
    p.add_argument("--parametrizations", nargs="+", default=["sp", "mup"])
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="init seed; the training batches are drawn with seed + 1")
    p.add_argument("--out", help="write the result as JSON here")
    p.add_argument("--md", help="write the result as a Markdown table here")
    p.add_argument(
        "--from-json",
        nargs="+",
        help="only merge these JSON reports (of one grid, other parametrizations) into --out / --md",
    )
    return p


def tokens(split: str) -> np.ndarray:
    """All tokens of one split of the embedded corpus, concatenated."""
    directory = embedded_corpus().split(split)
    manifest = read_manifest(directory)
    return np.concatenate([np.asarray(open_shard(directory, info, manifest.dtype)) for info in manifest.shards])


def batches(data: np.ndarray, count: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    """`count` batches of `batch` random windows of seq + 1 tokens (the same ones for every run)."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(data) - seq - 1, size=(count, batch))
    return [torch.from_numpy(np.stack([data[s : s + seq + 1] for s in row]).astype(np.int64)) for row in starts]


def model_config(width: int, args: argparse.Namespace, parametrization: str, vocab: int) -> ModelConfig:
    mup = {"mup_base_dim": min(args.widths)} if parametrization == "mup" else {}
    return ModelConfig(
        dim=width,
        n_layers=args.n_layers,
        n_heads=width // args.head_dim,
        vocab_size=vocab,
        ffn_hidden_dim=2 * width,
        max_seq_len=args.seq_len,
        parametrization=parametrization,
        **mup,
    )


def run(cfg: ModelConfig, lr: float, args: argparse.Namespace, train: list, held_out: list) -> float:
    """Held-out loss after training `cfg` at `lr` (nan if it diverged)."""
    torch.manual_seed(args.seed)
    model = build_model(cfg)
    optimizer = build_optimizer(
        model, OptimizerConfig.model_validate({"name": args.optimizer, "lr": lr, "weight_decay": 0.0})
    )

    def factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / (args.warmup + 1)
        progress = (step - args.warmup) / max(1, args.steps - args.warmup - 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    for batch in train:
        loss = cross_entropy(model(batch[:, :-1]), batch[:, 1:])
        if not torch.isfinite(loss):
            return math.nan
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
    with torch.no_grad():
        losses = [cross_entropy(model(b[:, :-1]), b[:, 1:]).item() for b in held_out]
    return float(np.mean(losses))


def markdown(report: dict) -> str:
    """Held-out loss per width and learning rate, for each parametrization, the best marked in bold, and
    where the best learning rate went as the width grew."""
    args, rows = report["args"], report["results"]
    lrs = args["lrs"]
    lines = [f"Optimizer: {args.get('optimizer', 'adamw')}.", ""]
    for parametrization in args["parametrizations"]:
        lines += [f"### {parametrization}", "", "| width | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | best lr |"]
        lines.append("|---" * (len(lrs) + 2) + "|")
        for width in args["widths"]:
            losses = {
                r["lr"]: r["held_out_loss"]
                for r in rows
                if r["width"] == width and r["parametrization"] == parametrization
            }
            best = report["best_lr"][f"{parametrization}/{width}"]
            cells = [f"**{losses[lr]:.3f}**" if lr == best else f"{losses[lr]:.3f}" for lr in lrs]
            lines.append(f"| {width} | " + " | ".join(cells) + f" | {best:g} |")
        bests = [report["best_lr"][f"{parametrization}/{w}"] for w in args["widths"]]
        steps = [round(math.log(b / bests[0], math.sqrt(10))) for b in bests]  # grid steps of ×sqrt(10)
        moved = (
            "stayed"
            if len(set(bests)) == 1
            else f"moved by {steps} grid steps (×√10 each) from width {args['widths'][0]}"
        )
        lines += [
            "",
            f"Best learning rate under {parametrization}: {', '.join(f'{b:g}' for b in bests)} — {moved}.",
            "",
        ]
    return "\n".join(lines)


def merged(reports: list[dict]) -> dict:
    """Reports of the same grid for different parametrizations (run side by side) as one report."""
    first = reports[0]
    for other in reports[1:]:
        same = {k: v for k, v in other["args"].items() if k not in ("parametrizations", "out", "md", "from_json")}
        assert same == {k: first["args"][k] for k in same}, "the reports are not of one grid"
        assert other["commit"] == first["commit"], "the reports are of different commits"
    args = {**first["args"], "parametrizations": [p for r in reports for p in r["args"]["parametrizations"]]}
    return {
        **first,
        "args": args,
        "results": [row for r in reports for row in r["results"]],
        "best_lr": {k: v for r in reports for k, v in r["best_lr"].items()},
        "seconds": [r["seconds"] for r in reports],
        "machine": f"{first['machine']}, {len(reports)} processes side by side",
    }


def main() -> None:
    args = parser().parse_args()
    if args.from_json:
        reports = []
        for path in args.from_json:
            with open(path) as f:
                reports.append(json.load(f))
        report = merged(reports)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
        if args.md:
            with open(args.md, "w") as f:
                f.write(markdown(report))
        print(markdown(report))
        return
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    torch.set_num_threads(args.threads)
    train_tokens, val_tokens = tokens("train"), tokens("val")
    vocab = int(read_manifest(embedded_corpus().train).vocab_size)
    train = batches(train_tokens, args.steps, args.batch_size, args.seq_len, seed=args.seed + 1)
    held_out = batches(val_tokens, args.eval_batches, args.batch_size, args.seq_len, seed=2)
    results = []
    started = time.perf_counter()
    for width in args.widths:
        for parametrization in args.parametrizations:
            cfg = model_config(width, args, parametrization, vocab)
            for lr in args.lrs:
                t0 = time.perf_counter()
                loss = run(cfg, lr, args, train, held_out)
                row = {"width": width, "parametrization": parametrization, "lr": lr, "held_out_loss": loss}
                row["seconds"] = round(time.perf_counter() - t0, 1)
                results.append(row)
                print(json.dumps(row), flush=True)
    best = {}
    for width in args.widths:
        for parametrization in args.parametrizations:
            rows = [r for r in results if r["width"] == width and r["parametrization"] == parametrization]
            finite = [r for r in rows if math.isfinite(r["held_out_loss"])]
            best[f"{parametrization}/{width}"] = min(finite, key=lambda r: r["held_out_loss"])["lr"] if finite else None
    report = {
        "results": results,
        "best_lr": best,
        "tokens_per_run": args.steps * args.batch_size * args.seq_len,
        "args": vars(args),
        "seconds": round(time.perf_counter() - started, 1),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s)",
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "commit": commit,
    }
    print(json.dumps(report["best_lr"], indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(report))


if __name__ == "__main__":
    main()
