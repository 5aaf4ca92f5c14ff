"""Tokens/s the training loader delivers for a 3-source mixture with document packing, against what the
debug model consumes, and the loader's resident memory at two dataset sizes 10× apart.

Builds three synthetic `forge tokenize`-format sources (random tokens, documents of 50–4,000 tokens each
ended by EOS, uint16) in a temporary directory, opens them as `[[data.datasets]]` with
`data.pack_sequences = true` at the debug preset's shape (batch 8 × 256, temperature 2), and times, in
alternating rounds in one process:

- loader: `TrainData.batches()` micro-batches plus the packing work a step does per batch (document ids,
  per-document positions, the block-diagonal mask), i.e. everything before the model sees the batch;
- model: the debug model's training step (forward, backward, AdamW) on the same batches' shape, fp32 CPU.

The model uses torch's default threads (all cores), the loader its one (num_workers = 0, as the debug
preset). Memory: a child process per size opens the mixture and draws the same number of batches; the
growth of its resident memory (VmRSS, split into anonymous and file-backed pages, /proc/self/status) is what
the loader holds. Shards are memory-mapped, so only the pages of the windows drawn become resident,
whatever the dataset's size.

    python benchmarks/bench_loader.py --out benchmarks/results/loader_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.plan import check_config

EOS = 0
VOCAB = 4096


def write_source(directory: Path, tokens: int, seed: int, shard_tokens: int = 5_000_000) -> None:
    """A forge-token-shards directory of random documents (no tokenizer.json: the loader then trusts the
    manifest's fingerprint alone, as it does for shards whose tokenizer is not beside them)."""
    from engine.data.shards import Manifest, ShardInfo, shard_name, write_manifest

    directory.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    stream = rng.integers(1, VOCAB, tokens, dtype=np.uint16)
    ends = np.cumsum(rng.integers(50, 4000, tokens // 50))
    ends = ends[ends < tokens]
    stream[ends] = EOS
    shards = []
    for index, start in enumerate(range(0, tokens, shard_tokens)):
        part = stream[start : start + shard_tokens]
        np.save(directory / shard_name(index), part)
        shards.append(ShardInfo(shard_name(index), len(part), int((part == EOS).sum())))
    write_manifest(directory, Manifest("0" * 64, VOCAB, EOS, "<|endoftext|>", "uint16", tuple(shards)))


def mixture_config(root: Path, seq_len: int, batch_size: int):
    from engine.config import load_job_config

    sources = ", ".join(f'{{name="s{i}", path="{root / f"s{i}"}", weight={w}}}' for i, w in enumerate((6, 3, 1)))
    return check_config(
        load_job_config(
            "presets/debug.toml",
            [
                f"--data.datasets=[{sources}]",
                "--data.mix_temperature=2.0",
                "--data.pack_sequences=true",
                "--eval.enabled=false",
                f"--train.seq_len={seq_len}",
                f"--train.batch_size={batch_size}",
            ],
        )
    )


def packed(inputs):
    from engine.model.documents import document_ids, document_mask, document_positions

    ids = document_ids(inputs, EOS)
    return document_positions(ids), document_mask(ids)


def time_loader(batches, steps: int, tokens_per_batch: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        inputs = next(batches)[0]  # a mixture's batch also carries its rows' sources
        packed(inputs)
    return steps * tokens_per_batch / (time.perf_counter() - start)


def time_model(cfg, steps: int) -> float:
    import torch

    from engine.model.documents import document_ids
    from engine.model.transformer import Transformer
    from engine.train.losses import cross_entropy

    model = Transformer(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t = cfg.train
    tokens = torch.randint(1, VOCAB, (t.batch_size, t.seq_len + 1))
    tokens[:, ::97] = EOS
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    start = time.perf_counter()
    for _ in range(steps):
        loss = cross_entropy(model(inputs, doc_ids=document_ids(inputs, EOS)), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return steps * t.batch_size * t.seq_len / (time.perf_counter() - start)


def resident_mib() -> dict[str, float]:
    """This process's resident memory now, anonymous (the loader's own arrays) and file-backed (the pages of
    the memory-mapped shards it touched), from /proc/self/status."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "RssAnon", "RssFile")}


def rss_child(root: str, steps: int, seq_len: int, batch_size: int) -> None:
    """Run in a child: open the mixture at `root`, draw `steps` batches (and the per-source metrics, which
    replay every step's draws), print how much the resident memory grew, in MiB."""
    import torch  # noqa: F401  (imported before the first reading, like everything the loader uses)

    from engine.data.loader import open_train_data

    cfg = mixture_config(Path(root), seq_len, batch_size)
    before = resident_mib()
    data = open_train_data(cfg)
    batches = data.batches()
    for _ in range(steps):
        packed(next(batches)[0])
    data.metrics(steps)
    after = resident_mib()
    grown = {f"{key}_growth_mib": round(after[key] - before[key], 2) for key in before}
    print(json.dumps({**grown, "windows": data.num_samples}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens-per-source", type=int, default=2_000_000, help="the small size; the large is 10×")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--loader-steps", type=int, default=300, help="batches per loader round")
    p.add_argument("--model-steps", type=int, default=3, help="training steps per model round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rss-steps", type=int, default=1000)
    p.add_argument("--out")
    p.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rss_child:
        return rss_child(args.rss_child, args.rss_steps, args.seq_len, args.batch_size)

    from engine.data.loader import open_train_data

    with tempfile.TemporaryDirectory() as tmp:
        roots = {"small": Path(tmp) / "small", "large": Path(tmp) / "large"}
        for scale, root in zip((1, 10), roots.values()):
            for i in range(3):
                write_source(root / f"s{i}", scale * args.tokens_per_source, seed=i)
        cfg = mixture_config(roots["small"], args.seq_len, args.batch_size)
        batches = open_train_data(cfg).batches()
        tokens_per_batch = args.batch_size * args.seq_len
        time_loader(batches, 20, tokens_per_batch)  # warm-up: page in, build the first permutations
        time_model(cfg, 1)
        loader, model = [], []
        for _ in range(args.rounds):  # alternating, so both see the same load on the shared machine
            loader.append(time_loader(batches, args.loader_steps, tokens_per_batch))
            model.append(time_model(cfg, args.model_steps))
        rss = {}
        for name, root in roots.items():
            command = [sys.executable, __file__, "--rss-child", str(root), "--rss-steps", str(args.rss_steps)]
            command += ["--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size)]
            result = subprocess.run(command, capture_output=True, text=True, check=True)
            rss[name] = json.loads(result.stdout.strip().splitlines()[-1])
    report = {
        "loader_tokens_per_sec": statistics.median(loader),
        "model_tokens_per_sec": statistics.median(model),
        "margin": statistics.median(loader) / statistics.median(model),
        "rounds": {"loader": loader, "model": model},
        "rss": {name: {**v, "tokens": 3 * s * args.tokens_per_source} for (name, v), s in zip(rss.items(), (1, 10))},
        "args": {k: v for k, v in vars(args).items() if k != "rss_child"},
    }
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
