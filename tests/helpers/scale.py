"""The tiny model of the scaling-study tests."""

from __future__ import annotations

# A study small enough for the suite: 2-layer 64-wide models (the family's smallest sensible member) on the embedded
# corpus, 128 tokens per step; budgets that give 3 sizes each of 10-80 steps.
TINY = """
[model]
dim = 64
n_layers = 2
n_heads = 2
vocab_size = 4096
max_seq_len = 32
[train]
batch_size = 4
seq_len = 32
max_steps = 100
mixed_precision = "fp32"
loss_fn = "chunked_cross_entropy"
[optimizer]
lr = 3e-3
[scheduler]
warmup_steps = 10
[eval]
enabled = true
steps = 2
[metrics]
log_interval = 1000
"""
