"""`forge extract` throughput and memory, side by side with what a user would otherwise run.

1. Extraction tokens/s vs Hugging Face `transformers` with `output_hidden_states=True` on the exported model
   (`forge convert to-hf`), same tokens, same layers, both writing the requested layers to disk: Forge stops
   the forward after the deepest requested block, `transformers` runs every layer and the head.
2. Overhead of extracting (and writing) every block vs a plain forward of the same model over the same tokens.
3. Peak RSS of a `forge extract` process writing ≥ 2 GB of activations (a fresh process, so the figure is
   its own), the output deleted afterwards.

Rounds alternate (ours, theirs, theirs, ours, …) so machine drift hits both alike; medians are reported.
The model is the debug preset's shape with random weights (throughput does not depend on the values);
tokens are the embedded Shakespeare corpus's training split.

    python benchmarks/bench_extract.py --out extract.json
    python benchmarks/bench_extract.py --rss-gb 0   # skip the 2 GB run
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import transformers
from bench_args import emit

from engine.checkpoint.dcp import save_checkpoint
from engine.checkpoint.hf import export_to_hf
from engine.config import JobConfig, dump_toml
from engine.config.model import ModelConfig
from engine.data.embedded import embedded_corpus
from engine.interp.extract import Extraction, ExtractRequest
from engine.model.transformer import Transformer

REPO = Path(__file__).resolve().parents[1]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=6)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--windows", type=int, default=64, help="windows timed per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rss-gb", type=float, default=2.0, help="GB of activations the RSS run writes (0: skip)")
    p.add_argument("--out", help="write the result as JSON here")
    return p.parse_args()


def make_run(root: Path, cfg: ModelConfig, tokenizer: Path) -> Path:
    torch.manual_seed(0)
    model = Transformer(cfg)
    run = root / "run"
    run.mkdir()
    (run / "config.toml").write_text(dump_toml(JobConfig(model=cfg)))
    shutil.copy(tokenizer, run / "tokenizer.json")
    save_checkpoint(run / "checkpoints", 1, model, torch.optim.AdamW(model.parameters()), {"step": 1})
    return run


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def ours(job: Extraction, out: Path) -> float:
    """One extraction into a fresh folder (shards fsynced, manifest written)."""
    shutil.rmtree(out, ignore_errors=True)
    job.out = out
    return timed(job.run)


def hf_extract(hf: torch.nn.Module, batches: list[torch.Tensor], layers: list[int], out: Path) -> float:
    """What a user of `transformers` writes: forward with hidden states, the wanted ones saved to disk."""

    def run() -> None:
        with open(out, "wb") as f, torch.no_grad():
            for batch in batches:
                hidden = hf(batch, output_hidden_states=True).hidden_states
                for n in layers:
                    np.save(f, hidden[n + 1].reshape(-1, hidden[n + 1].shape[-1]).numpy())
            f.flush()
            os.fsync(f.fileno())

    return timed(run)


def plain_forward(model: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    def run() -> None:
        with torch.no_grad():
            for batch in batches:
                model(batch)

    return timed(run)


def alternate(pairs: int, first, second) -> tuple[list[float], list[float]]:
    """Alternating rounds: a b, b a, a b, … (after one warm-up of each)."""
    first(), second()
    a, b = [], []
    for r in range(pairs):
        if r % 2 == 0:
            a.append(first())
            b.append(second())
        else:
            b.append(second())
            a.append(first())
    return a, b


def rss_run(run: Path, data: Path, root: Path, gb: float, cfg: ModelConfig, seq: int) -> dict:
    """`forge extract` in its own process writing about `gb` GB: its peak RSS (ru_maxrss of the child)."""
    modules = 3 * cfg.n_layers  # layers.*, layers.*.attention, layers.*.feed_forward
    tokens = int(gb * 1e9 / (modules * cfg.dim * 4)) // seq * seq + seq
    out = root / "rss"
    command = [sys.executable, "-m", "forgecli.app", "extract", str(run), "--out", str(out), "--data", str(data)]
    command += ["--layers", "layers.*,layers.*.attention,layers.*.feed_forward", "--max-tokens", str(tokens)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    written = sum(p.stat().st_size for p in out.iterdir())
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    shutil.rmtree(out)
    return {"tokens": tokens, "bytes_written": written, "peak_rss_bytes": peak, "seconds": seconds}


def main() -> None:
    args = parse()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    cfg = ModelConfig(
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        vocab_size=4096,
        max_seq_len=args.seq_len,
    )
    corpus = embedded_corpus()
    root = Path(tempfile.mkdtemp(prefix="bench-extract-"))
    try:
        run = make_run(root, cfg, corpus.train / "tokenizer.json")
        export_to_hf(run, root / "hf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
        tokens = args.windows * args.seq_len
        lower = [f"layers.{n}" for n in range(args.n_layers // 2)]
        request = ExtractRequest(
            data=str(corpus.train), max_tokens=tokens, batch_size=args.batch_size, seq_len=args.seq_len, dtype="fp32"
        )
        half = Extraction(run, root / "half", replace(request, layers=tuple(lower)))
        every = Extraction(run, root / "every", replace(request, layers=("layers.*",)))
        stream = half.tokens.read(0, tokens).reshape(-1, args.seq_len)
        batches = [torch.from_numpy(stream[i : i + args.batch_size]) for i in range(0, len(stream), args.batch_size)]
        indices = list(range(args.n_layers // 2))

        a, b = alternate(
            args.rounds, lambda: ours(half, root / "half"), lambda: hf_extract(hf, batches, indices, root / "hf.npy")
        )
        c, d = alternate(args.rounds, lambda: ours(every, root / "every"), lambda: plain_forward(every.model, batches))
        lower_ours, lower_hf = tokens / statistics.median(a), tokens / statistics.median(b)
        every_ours, plain = tokens / statistics.median(c), tokens / statistics.median(d)
        report = {
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, {torch.get_num_threads()} threads",
            "model": cfg.model_dump(include={"dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size"}),
            "tokens_per_round": tokens,
            "batch": [args.batch_size, args.seq_len],
            "lower_half": {
                "layers": lower,
                "forge_tokens_per_s": round(lower_ours),
                "transformers_tokens_per_s": round(lower_hf),
                "speedup": round(lower_ours / lower_hf, 3),
            },
            "every_block": {
                "forge_extract_tokens_per_s": round(every_ours),
                "plain_forward_tokens_per_s": round(plain),
                "time_ratio_extract_over_forward": round(plain / every_ours, 3),
            },
        }
        if args.rss_gb > 0:
            report["rss"] = rss_run(run, corpus.train, root, args.rss_gb, cfg, args.seq_len)
        emit(report, args.out)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
