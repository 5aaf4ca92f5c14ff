"""GPT-2's tensor-parallel plan as data (engine/parallel/tp.py makes DTensor styles of it): Megatron-style with
sequence parallelism, as the transformer's, with biases and learned positions.

- Both embeddings are vocabulary-style lookups: the token table sharded by token rows, the position table by
  position rows, each lookup's partial sums reduce-scattered over the sequence, so each rank holds its own
  positions of both and their sum is the one-device sum cut to those positions.
- LayerNorms sequence parallel (weight and bias replicated, their gradients summed over the ranks).
- wq/wk/wv and w1 column-sharded, their biases with their rows (whole heads, whole hidden units per rank);
  wo and w2 row-sharded, reduce-scattered back to the residual stream; their biases replicated and added once,
  after the reduction (RowwiseParallel's handling of a bias).
- The head vocabulary-sharded, tied to the token table.
"""

from __future__ import annotations

from engine.config.model import ModelConfig
from engine.model.spec import TPPlan, TPStyle

COLWISE, ROWWISE, NORM = TPStyle("colwise"), TPStyle("rowwise"), TPStyle("sequence_parallel")


def block_plan(cfg: ModelConfig, layer: int) -> dict[str, TPStyle]:
    """Module name inside a block → its style: two all-gathers and two reduce-scatters per block."""
    return {
        "attention_norm": NORM,
        # (x, cache): only x is sharded.
        "attention": TPStyle("gather_sequence", inputs=2),
        "attention.wq": COLWISE,
        "attention.wk": COLWISE,
        "attention.wv": COLWISE,
        "attention.wo": ROWWISE,
        "ffn_norm": NORM,
        "feed_forward": TPStyle("gather_sequence"),
        "feed_forward.w1": COLWISE,
        "feed_forward.w2": ROWWISE,
    }


PLAN = TPPlan(
    outer={
        "tok_embeddings": TPStyle("vocab_embedding"),
        "pos_embeddings": TPStyle("vocab_embedding"),
        "norm": NORM,
        "output": TPStyle("vocab_head"),
    },
    block=block_plan,
    tied=("output", "tok_embeddings"),
)
