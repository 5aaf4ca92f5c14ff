"""What autograd saves for one GPT-2 block, per rank, for the memory estimate (engine/parallel/memory.py).
Torch-free. The attention part is the transformer family's count with one key/value head per query head
(engine/model/families/transformer/activations.py derives it); what differs is the norms (always
LayerNorm) and the MLP (one biased linear into GELU, one out)."""

from __future__ import annotations

from engine.config.model import ModelConfig
from engine.model.families.transformer.activations import context_parallel_bytes
from engine.model.spec import ActivationLayout

FP32 = 4


def norm_bytes(m: ModelConfig, lay: ActivationLayout) -> int:
    """Saved per token by one LayerNorm: its input, mean and 1/std (fp32)."""
    return lay.residual * m.dim + 2 * FP32


def block_activation_bytes(m: ModelConfig, lay: ActivationLayout, layer: int, tokens: int) -> int:
    """Bytes autograd saves for one block over `tokens` tokens on one rank, without activation checkpointing.

    Per token, with h = dim, f = ffn_dim, c = compute bytes, ρ = residual-stream bytes:
      LayerNorms ×2:   ρ·h + 8 each (`norm_bytes`)
      attention:       the normed input as wq, wk and wv read it (c·h, or 3·c·h under autocast, which casts
                       it once per projection); q, k, v and SDPA's output (c·4h; the biases add nothing, an
                       addmm keeps only its input) and the log-sum-exp (4·heads); with SDPA's math kernel
                       (sdpa_backend = "math") instead c·h + 4·(3h + heads·seq_len): its fp32 copies of q, k
                       and v (v, its output) and the attention weights
      MLP:             the normed input w1 reads (c·h), w1's output (GELU's input) and GELU's output (w2's
                       input): c·2f
    Tensor parallelism with sequence parallelism divides all but the projections' inputs by tp (they are
    all-gathered over the sequence and kept whole); a context-parallel attention core adds what it keeps
    (the transformer family's `context_parallel_bytes`, with kv_heads = n_heads)."""
    h, c = m.dim, lay.compute
    gathered = c * (3 if lay.casts else 1) * h + c * h
    if m.sdpa_backend == "math":
        split = c * h + FP32 * (3 * h + m.n_heads * lay.seq_len)
    else:
        split = c * 4 * h + FP32 * m.n_heads
    split += 2 * norm_bytes(m, lay) + c * 2 * m.ffn_dim + context_parallel_bytes(m, lay)
    return tokens * gathered + tokens * split // lay.tp


def checkpointed_block_bytes(m: ModelConfig, lay: ActivationLayout, layer: int, tokens: int, mode: str) -> int:
    """Saved bytes per block and rank under activation checkpointing. full: the block's input (the residual
    stream, sequence parallel under tp). selective (keep every matmul's and SDPA's output, recompute norms
    and GELU): the input plus q, k, v, SDPA's output and log-sum-exp, and the outputs of wo, w1 and w2."""
    h, c, r = m.dim, lay.compute, lay.residual
    if mode == "full":
        return tokens * r * h // lay.tp
    return tokens * (r * h + c * (6 * h + m.ffn_dim) + FP32 * m.n_heads) // lay.tp
