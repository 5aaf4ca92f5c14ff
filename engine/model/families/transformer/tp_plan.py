"""The transformer's tensor-parallel plan as data (engine/parallel/tp.py makes DTensor styles of it).

Megatron-style with sequence parallelism: the token embedding vocabulary-sharded, its output scattered over
the sequence; norms sequence parallel; attention and dense MLP inputs gathered over the sequence, wq/wk/wv
and w1/w3 column-sharded (whole heads / hidden units per rank), wo and w2 row-sharded with a reduce-scatter
back to the sequence-sharded residual stream; QK-norm over head-sharded q and k; the head vocabulary-sharded.
An MoE layer runs on the full tokens on every rank (identical routing, auxiliary losses and load as on one
device), its router replicated, its shared experts column/row-sharded with their output all-reduced; its
routed experts are sharded by engine/parallel/expert.py.
"""

from __future__ import annotations

from engine.config.model import ModelConfig
from engine.model.spec import TPPlan, TPStyle

COLWISE, ROWWISE, NORM = TPStyle("colwise"), TPStyle("rowwise"), TPStyle("sequence_parallel")


def block_plan(cfg: ModelConfig, layer: int) -> dict[str, TPStyle]:
    """Module name inside block `layer` → its style: two all-gathers and two reduce-scatters per block."""
    if cfg.is_moe_layer(layer):
        feed_forward = {"feed_forward": TPStyle("full_tokens"), "feed_forward.router": TPStyle("replicated_router")}
        if cfg.moe_shared_experts:
            feed_forward |= {
                "feed_forward.shared.w1": COLWISE,
                "feed_forward.shared.w3": COLWISE,
                "feed_forward.shared.w2": TPStyle("rowwise_replicate"),
            }
    else:
        feed_forward = {
            "feed_forward": TPStyle("gather_sequence"),
            "feed_forward.w1": COLWISE,
            "feed_forward.w3": COLWISE,
            "feed_forward.w2": ROWWISE,
        }
    plan = {
        "attention_norm": NORM,
        # (x, cos, sin, cache): only x is sharded; the RoPE tables are plain tensors every rank holds in full.
        "attention": TPStyle("gather_sequence", inputs=4),
        "attention.wq": COLWISE,
        "attention.wk": COLWISE,
        "attention.wv": COLWISE,
        "attention.wo": ROWWISE,
        "ffn_norm": NORM,
        **feed_forward,
    }
    if cfg.qk_norm:
        plan |= {"attention.q_norm": TPStyle("head_sharded_norm"), "attention.k_norm": TPStyle("head_sharded_norm")}
    return plan


PLAN = TPPlan(
    outer={
        "tok_embeddings": TPStyle("vocab_embedding"),
        "norm": NORM,
        "output": TPStyle("vocab_head"),
    },
    block=block_plan,
    tied=("output", "tok_embeddings"),
)
