"""Training data: tokenizing text into memory-mapped token shards, and reading them back in a fixed order.

- `engine.data.tokenize.tokenize`: text / JSONL / Parquet files (`engine.data.sources`) or a Hugging Face
  dataset (`engine.data.hub`) → `shard-NNNNN.npy` + `manifest.json`.
- `engine.data.loader.open_train_data` / `open_eval_data`: verified shards → micro-batches for the training loop.
- `engine.data.embedded.embedded_corpus`: the Shakespeare corpus shipped in the package, tokenized once into a cache.

Importing this package is cheap: torch is only imported by `engine.data.loader` and `engine.data.sampler`.
"""

DEFAULT_SHARD_TOKENS = 50_000_000  # 100 MB per uint16 shard: few files, little work lost to an interruption
