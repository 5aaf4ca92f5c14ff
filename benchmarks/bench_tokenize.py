"""`forge tokenize` vs `datasets` (`load_dataset("json")` + batched `Dataset.map`), same tokenizer, same input.

The input is the embedded Shakespeare corpus cut into ~4 KB documents and repeated to the requested size,
as one JSONL file; the tokenizer is a byte-level BPE trained on the corpus. `forge tokenize` and the main
`datasets` rows call the same `Tokenizer.encode_batch_fast`, so their ratio measures the pipelines around
it (reading, parallelism, writing). One more `datasets` row uses `encode_batch` (with character offsets),
the call `transformers` fast tokenizers make, i.e. what a typical `Dataset.map` tokenization runs.
Each measurement is a fresh subprocess (no warm caches, no tokenizer state shared through fork), and the
contenders run in alternating rounds so drift on a shared machine hits all of them alike.

    python benchmarks/bench_tokenize.py                # ~30 MB, 3 rounds
    python benchmarks/bench_tokenize.py --mb 50 --rounds 5 --vocab-size 32000
"""

from __future__ import annotations

import argparse
import gzip
import importlib.metadata as md
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine.data.embedded import CORPUS
from engine.data.tokenizer import Encoder

DATASETS_JOB = """
import json, sys, time
import datasets, pyarrow.compute as pc
from tokenizers import Tokenizer
source, tokenizer_file, cache, num_proc, method = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) or None, sys.argv[5]
datasets.disable_progress_bars()
start = time.perf_counter()
tokenizer = Tokenizer.from_file(tokenizer_file)
encode_batch = getattr(tokenizer, method)
ds = datasets.load_dataset("json", data_files=source, split="train", cache_dir=cache)
loaded = time.perf_counter()
def encode(batch):
    return {"input_ids": [e.ids for e in encode_batch(batch["text"], add_special_tokens=False)]}
out = ds.map(encode, batched=True, batch_size=1000, num_proc=num_proc, remove_columns=ds.column_names)
done = time.perf_counter()
tokens = pc.sum(pc.list_value_length(out.data.column("input_ids"))).as_py()
print(json.dumps({"seconds": done - start, "map_seconds": done - loaded, "tokens": tokens}))
"""

# The alternative design for forge tokenize's parallelism: a process pool, one single-threaded encoder per
# core, fed ~1 MB batches and returning token arrays (pickled). Reads the same JSONL; writes nothing.
POOL_JOB = """
import json, os, sys, time
from multiprocessing import Pool
import numpy as np
from tokenizers import Tokenizer
source, tokenizer_file, processes = sys.argv[1], sys.argv[2], int(sys.argv[3])
def start():
    global tokenizer
    tokenizer = Tokenizer.from_file(tokenizer_file)
def encode(texts):
    return [np.array(e.ids + [0], np.uint16) for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
def batches():
    batch, chars = [], 0
    with open(source, "rb") as f:
        for line in f:
            batch.append(json.loads(line)["text"])
            chars += len(batch[-1])
            if chars >= 1_000_000:
                yield batch
                batch, chars = [], 0
    yield batch
begin = time.perf_counter()
with Pool(processes, initializer=start) as pool:
    tokens = sum(len(a) for arrays in pool.imap(encode, batches()) for a in arrays)
print(json.dumps({"seconds": time.perf_counter() - begin, "tokens": tokens}))
"""


def documents(chars: int = 4000) -> list[str]:
    """The corpus works cut at paragraph breaks into documents of about `chars` characters."""
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        works = [json.loads(line)["text"] for line in f]
    docs: list[str] = []
    for work in works:
        part: list[str] = []
        for paragraph in work.split("\n\n"):
            part.append(paragraph)
            if sum(map(len, part)) >= chars:
                docs.append("\n\n".join(part))
                part = []
        if part:
            docs.append("\n\n".join(part))
    return docs


def write_input(path: Path, megabytes: float) -> int:
    lines = [json.dumps({"text": d}) + "\n" for d in documents()]
    copies = max(1, round(megabytes * 1e6 / sum(map(len, lines))))
    with open(path, "w") as f:
        for _ in range(copies):
            f.writelines(lines)
    return path.stat().st_size


def run_json(cmd: list[str], **env: str) -> tuple[float, dict]:
    """Run a job that prints one JSON object; its wall time includes interpreter start and imports."""
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1", **env})
    wall = time.perf_counter() - start
    if result.returncode:
        sys.exit(f"{' '.join(cmd[:3])} failed:\n{result.stderr}")
    return wall, json.loads(result.stdout)


def run_forge(work: Path, source: Path, tokenizer: Path) -> dict:
    out = work / "forge-out"
    shutil.rmtree(out, ignore_errors=True)
    wall, report = run_json(
        [
            sys.executable,
            "-m",
            "forgecli.app",
            "tokenize",
            str(source),
            "--tokenizer",
            str(tokenizer),
            "--out",
            str(out),
            "--json",
        ]
    )
    return {"wall": wall, "seconds": report["seconds"], "tokens": report["manifest"]["total_tokens"]}


def run_datasets(work: Path, source: Path, tokenizer: Path, num_proc: int, method: str = "encode_batch_fast") -> dict:
    cache = work / "hf-cache"
    shutil.rmtree(cache, ignore_errors=True)
    wall, report = run_json(
        [sys.executable, "-c", DATASETS_JOB, str(source), str(tokenizer), str(cache), str(num_proc), method]
    )
    return {"wall": wall, **report}


def run_pool(source: Path, tokenizer: Path, processes: int) -> dict:
    wall, report = run_json(
        [sys.executable, "-c", POOL_JOB, str(source), str(tokenizer), str(processes)], TOKENIZERS_PARALLELISM="false"
    )
    return {"wall": wall, **report}


def versions() -> str:
    packages = ", ".join(f"{p} {md.version(p)}" for p in ("tokenizers", "datasets", "pyarrow", "numpy"))
    return f"Python {platform.python_version()}, {packages}; {platform.platform()}; {os.cpu_count()} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=30.0, help="input size in MB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab-size", type=int, default=32000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as tmp:
        work = Path(tmp)
        source = work / "input.jsonl"
        size = write_input(source, args.mb)
        tokenizer = work / "tokenizer.json"
        tokenizer.write_bytes(Encoder.trained(documents(), args.vocab_size).json_bytes)
        contenders = {
            "forge tokenize": lambda: run_forge(work, source, tokenizer),
            "process pool of 2 single-threaded encoders": lambda: run_pool(source, tokenizer, 2),
            "datasets map, num_proc=None": lambda: run_datasets(work, source, tokenizer, 0),
            "datasets map, num_proc=2": lambda: run_datasets(work, source, tokenizer, 2),
            "datasets map with encode_batch, num_proc=None": lambda: run_datasets(
                work, source, tokenizer, 0, "encode_batch"
            ),
        }
        runs: dict[str, list[dict]] = {name: [] for name in contenders}
        for _ in range(args.rounds):
            for name, run in contenders.items():
                runs[name].append(run())
        print(f"input: {size / 1e6:.1f} MB JSONL; tokenizer: byte-level BPE, vocab {args.vocab_size}; {versions()}\n")
        print(
            "| pipeline | tokens | median wall s | median in-process s | M tokens/s (wall) | M tokens/s (in-process) |"
        )
        print("|---|---|---|---|---|---|")
        for name, results in runs.items():
            wall = statistics.median(r["wall"] for r in results)
            inner = statistics.median(r["seconds"] for r in results)
            tokens = results[0]["tokens"]
            print(
                f"| {name} | {tokens:,} | {wall:.2f} | {inner:.2f} | {tokens / wall / 1e6:.2f} | {tokens / inner / 1e6:.2f} |"
            )
        print("\nall runs (wall s):", json.dumps({n: [round(r["wall"], 2) for r in rs] for n, rs in runs.items()}))


if __name__ == "__main__":
    main()
