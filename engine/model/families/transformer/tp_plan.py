"""The transformer's tensor-parallel plan as data (engine/parallel/tp.py makes DTensor styles of it).

Megatron-style with sequence parallelism: the token embedding vocabulary-sharded, its output scattered over
the sequence; norms sequence parallel; attention and dense MLP inputs gathered over the sequence, wq/wk/wv
and w1/w3 column-sharded (whole heads / hidden units per rank; wq's output gate rows with their heads, the
sink logits sharded by head), wo and w2 row-sharded with a reduce-scatter
back to the sequence-sharded residual stream; QK-norm over head-sharded q and k; the head vocabulary-sharded.
An MoE layer runs on the full tokens on every rank (identical routing, auxiliary losses and load as on one
device), its router replicated, its shared experts column/row-sharded with their output all-reduced; its
routed experts are sharded by engine/parallel/expert.py. Multi-token-prediction modules run on the same
sequence-sharded stream: norms, a gathered projection and a dense block.
"""

from __future__ import annotations

from engine.config.model import ModelConfig
from engine.model.spec import TPPlan, TPStyle

COLWISE, ROWWISE, NORM = TPStyle("colwise"), TPStyle("rowwise"), TPStyle("sequence_parallel")


def block_plan(cfg: ModelConfig, layer: int) -> dict[str, TPStyle]:
    """Module name inside block `layer` → its style: two all-gathers and two reduce-scatters per block."""
    return layer_plan(cfg, cfg.is_moe_layer(layer))


def layer_plan(cfg: ModelConfig, moe: bool) -> dict[str, TPStyle]:
    """A block's plan, with an MoE feed-forward or a dense one."""
    if moe:
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
    if cfg.attention_sinks:  # one logit per query head, sharded as wq shards the heads
        plan["attention.sinks"] = TPStyle("head_sharded_vector")
    return plan


def mtp_plan(cfg: ModelConfig) -> dict[str, TPStyle]:
    """A multi-token-prediction module (engine/model/mtp.py) on the main model's sequence-sharded stream: its
    norms sequence parallel, the 2·dim → dim projection gathered and cut back (`sequence_linear`: its input
    is the two norms' outputs, concatenated on every position), a dense block as the main model's, and its
    final norm; the embedding and head it uses are the main model's."""
    block = {f"block.{name}": style for name, style in layer_plan(cfg, moe=False).items()}
    return {
        "hidden_norm": NORM,
        "embed_norm": NORM,
        "proj": TPStyle("sequence_linear"),
        **block,
        "norm": NORM,
    }


PLAN = TPPlan(
    outer={
        "tok_embeddings": TPStyle("vocab_embedding"),
        "norm": NORM,
        "output": TPStyle("vocab_head"),
    },
    block=block_plan,
    tied=("output", "tok_embeddings"),
    mtp=mtp_plan,
)
