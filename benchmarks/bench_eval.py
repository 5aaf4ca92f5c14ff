"""`forge eval` requests/s vs lm-evaluation-harness's own Hugging Face model on the `forge convert to-hf` export.

Same task, same documents, same batch size, one process: Forge's adapter (`engine.eval.harness.ForgeLM`: requests
sharing a context scored as branches of it, packed into rows, the head only at scored positions) and lm_eval's
`hf` model (`HFLM`: requests sorted by length, padded to each batch's longest, a full-vocabulary log-softmax at
every position) on the exported `LlamaForCausalLM`. Requests/s counts the time inside the model's calls
(loglikelihood etc.), so the task building both share is left out; the end-to-end `simple_evaluate` time is
reported beside it. Rounds alternate (ours, theirs, theirs, ours, …); medians are reported. The two must agree
on every metric (the parity itself is tests/eval/test_eval.py's).

The model is the debug preset's shape with random weights (throughput does not depend on the values) and the
embedded corpus's tokenizer; the task is forge_next_line (4 choices per document).

    python benchmarks/bench_eval.py --limit 200 --batch-size 8 --out eval.json
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import lm_eval
import torch
import transformers
from bench_args import emit
from lm_eval import simple_evaluate
from lm_eval.api.model import LM
from lm_eval.models.huggingface import HFLM

from engine.checkpoint.dcp import save_checkpoint
from engine.checkpoint.hf import export_to_hf
from engine.config import JobConfig, dump_toml
from engine.config.model import ModelConfig
from engine.data.embedded import embedded_corpus
from engine.eval.harness import ForgeLM
from engine.eval.suite import load_tasks, quiet_harness, task_manager
from engine.generate import load_model
from engine.model.transformer import Transformer

REPO = Path(__file__).resolve().parents[1]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=6)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--tasks", default="forge_next_line")
    p.add_argument("--limit", type=int, default=200, help="documents per task")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of each (after one warm-up of each)")
    p.add_argument("--out", help="write the result as JSON here")
    return p.parse_args()


class Timed(LM):
    """Another LM with the seconds spent inside its request calls added up (what requests/s divides by)."""

    def __init__(self, inner: LM) -> None:
        super().__init__()
        self.inner, self.seconds, self.requests = inner, 0.0, 0

    def timed(self, name: str, requests: list) -> list:
        start = time.perf_counter()
        out = getattr(self.inner, name)(requests)
        self.seconds += time.perf_counter() - start
        self.requests += len(requests)
        return out

    def loglikelihood(self, requests):
        return self.timed("loglikelihood", requests)

    def loglikelihood_rolling(self, requests):
        return self.timed("loglikelihood_rolling", requests)

    def generate_until(self, requests):
        return self.timed("generate_until", requests)


def make_run(root: Path, cfg: ModelConfig, tokenizer: Path) -> Path:
    torch.manual_seed(0)
    model = Transformer(cfg)
    run = root / "run"
    run.mkdir()
    (run / "config.toml").write_text(dump_toml(JobConfig(model=cfg)))
    shutil.copy(tokenizer, run / "tokenizer.json")
    save_checkpoint(run / "checkpoints", 1, model, torch.optim.AdamW(model.parameters()), {"step": 1})
    return run


def evaluate(lm: LM, specs: list[str], limit: int) -> dict:
    timed = Timed(lm)
    manager = task_manager(specs, [])
    tasks = load_tasks(manager, specs)
    start = time.perf_counter()
    raw = simple_evaluate(model=timed, tasks=tasks, task_manager=manager, limit=limit, bootstrap_iters=0)
    wall = time.perf_counter() - start
    metrics = {f"{t}/{k}": v for t, r in raw["results"].items() for k, v in r.items() if isinstance(v, float)}
    return {"requests": timed.requests, "model_s": timed.seconds, "wall_s": wall, "metrics": metrics}


def rate(runs: list[dict]) -> float:
    return statistics.median(x["requests"] / x["model_s"] for x in runs)


def wall(runs: list[dict]) -> float:
    return statistics.median(x["wall_s"] for x in runs)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main() -> None:
    args = parse()
    quiet_harness()
    os.environ.setdefault("TQDM_DISABLE", "1")
    cfg = ModelConfig(
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        vocab_size=4096,
        max_seq_len=args.max_seq_len,
    )
    specs = args.tasks.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run = make_run(root, cfg, embedded_corpus().train / "tokenizer.json")
        export_to_hf(run, root / "hf")
        model, encoder = load_model(run, torch.device("cpu"))
        ours_lm = ForgeLM(model, encoder, args.batch_size)
        theirs_lm = HFLM(pretrained=str(root / "hf"), device="cpu", dtype="float32", batch_size=args.batch_size)
        ours, theirs = [evaluate(ours_lm, specs, args.limit)], [evaluate(theirs_lm, specs, args.limit)]  # warm-up
        assert ours[0]["metrics"] == theirs[0]["metrics"], (ours[0]["metrics"], theirs[0]["metrics"])
        ours, theirs = [], []
        for r in range(args.rounds):
            order = [(ours, ours_lm), (theirs, theirs_lm)]
            for results, lm in order if r % 2 == 0 else order[::-1]:
                results.append(evaluate(lm, specs, args.limit))
    report = {
        "tasks": specs,
        "limit": args.limit,
        "batch_size": args.batch_size,
        "requests": ours[0]["requests"],
        "forge_requests_per_s": rate(ours),
        "hf_requests_per_s": rate(theirs),
        "speedup": rate(ours) / rate(theirs),
        "forge_wall_s": wall(ours),
        "hf_wall_s": wall(theirs),
        "metrics": ours[0]["metrics"],
        "rounds": {"forge": ours, "hf": theirs},
        "model": cfg.model_dump(mode="json", exclude_none=True),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "threads": torch.get_num_threads(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__") else "",
        },
        "commit": commit(),
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
