"""What autograd saves for one transformer block, per rank, for the memory estimate (engine/parallel/memory.py),
which describes the job's precision and layout in an `ActivationLayout`. Torch-free."""

from __future__ import annotations

from engine.config.model import ModelConfig
from engine.model.spec import ActivationLayout

FP32 = 4
INT64 = 8


def norm_bytes(m: ModelConfig, lay: ActivationLayout) -> int:
    """Saved per token by one norm: CUDA's fused RMSNorm keeps its input and 1/rms (fp32), LayerNorm its
    input, mean and 1/std. (On CPU torch decomposes RMSNorm and also keeps the normalized input.)"""
    h, r = m.dim, lay.residual
    return r * h + FP32 if m.norm_type == "rmsnorm" else r * h + 2 * FP32


def math_attention(m: ModelConfig, lay: ActivationLayout) -> bool:
    """Whether SDPA runs its math kernel, which keeps the [heads, seq, seq] attention weights: when pinned to
    it, or on auto in fp32 with GQA (CUDA's flash kernel has no fp32, its memory-efficient one no GQA; seen on
    an H100 with torch 2.11), or with GQA and a sliding window (whose mask the flash kernel does not take)."""
    if m.sdpa_backend != "auto":
        return m.sdpa_backend == "math"
    return (lay.compute == FP32 or m.sliding_window is not None) and m.kv_heads < m.n_heads


def sink_attention_bytes(m: ModelConfig, lay: ActivationLayout) -> int:
    """Per token, what the eager sink kernel (engine.model.attention.sink_attention, model.attention_sinks)
    keeps for its backward: q and k, v repeated to every head (c·3q, the matmuls' inputs), the softmax's fp32
    weights with the sink's column 4·heads·(seq_len + 1), and below fp32 their copy in the compute dtype that
    the values' matmul reads, c·heads·seq_len (measured in tests/parallel/test_memory_estimate.py)."""
    c, heads, seq = lay.compute, m.n_heads, lay.seq_len
    return c * 3 * m.attention_dim + FP32 * heads * (seq + 1) + (c * heads * seq if c < FP32 else 0)


def window_bytes(m: ModelConfig, lay: ActivationLayout) -> int:
    """What a sliding window adds to one block: SDPA keeps the additive [seq, seq] mask it makes of the band
    (compute dtype; measured on CPU in tests/parallel/test_memory_estimate.py), except that the math kernel's saved
    weights already hold it, and packed windows' masks (engine/parallel/memory.py) already have the band.
    Attention runs on the whole sequence on every tp rank. The sink kernel keeps a boolean [seq, seq] mask
    instead, with or without a window (the causal one it makes, or the band), except for packed windows."""
    if m.attention_sinks:
        return 0 if lay.packed else lay.seq_len**2
    if m.sliding_window is None or lay.packed or math_attention(m, lay):
        return 0
    return lay.compute * lay.seq_len**2


def block_activation_bytes(m: ModelConfig, lay: ActivationLayout, layer: int, tokens: int) -> int:
    """Bytes autograd saves for one block over `tokens` tokens on one rank, without activation checkpointing.

    Counted per token, with h = dim, q = heads·head_dim (= h unless model.attention_head_dim is set),
    kv = kv_heads·head_dim, f = ffn width, c = compute bytes (matmul
    inputs/outputs), ρ = residual-stream bytes (fp32 under autocast); this is what the saved-tensor hooks of
    the real block record (tests/parallel/test_memory_estimate.py), and on an H100 what the allocator holds after
    forward (dense blocks within 1 %, QK-norm and MoE within 4 %), i.e. the Korthikanti et al. (2022) count
    sbh(34 + 5as/h) redone for this block: no dropout, SwiGLU, GQA, and flash-style SDPA, which keeps its
    output and logsumexp instead of the s² attention matrix:
      norms ×2:        ρ·h + 4 each for RMSNorm (input, 1/rms), ρ·h + 8 for LayerNorm (`norm_bytes`)
      attention:       c·r·h (the normed input as the projections read it) + c·(q + 2kv + q) (q, k, v after
                       RoPE, SDPA's output, which wo reads without a copy) + 4·heads (logsumexp); when SDPA
                       runs its math kernel (`math_attention`) c·(r·h + q) + 4·(3q + heads·seq_len)
                       (q, k and v repeated to all heads, and the attention weights, in fp32); a sliding
                       window adds the additive [seq, seq] mask SDPA makes of its band (`window_bytes`);
                       with sinks c·q + the eager sink kernel's (`sink_attention_bytes`) and its boolean mask
      output gate:     c·2q (sigmoid of the gates, the gated output); with QK-norm c·q more, as the norm's
                       saved queries are a view of wq's output, gates included
      dense MLP:       c·r'·h (normed input) + c·4f (w1 out, act(w1 out), w3 out, their product)
      MoE MLP:         4·(h + 2E) (router input, logits/probs) + c·k·(2h + 4f_e + 1) (each of the top-k
                       assignments: gathered input, the expert's SwiGLU, its weighted output) + 16k
                       (indices) + shared experts c·(r'·h + 4f_s); softmax_topk_renorm also
                       keeps the k weights and their sum it divides by, 4·(k + 1)
      QK-norm:         (c + 4)·(q + kv) + 4·(heads + kv_heads)
    r = r' = 1, except under autocast (compute below fp32 and no FSDP): r = 3, r' = 2, as autocast casts the
    fp32 norm output separately for each projection that reads it (wq, wk, wv; w1, w3) and each keeps its
    own copy. Tensor parallelism (with sequence parallelism) divides everything by tp except the
    projections' inputs, which are all-gathered over the sequence before wq/wk/wv and w1/w3, and autograd
    keeps the gathered tensor; MoE blocks are not tensor parallel.
    """
    tp, c = lay.tp, lay.compute
    h, q, kv = m.dim, m.attention_dim, m.kv_heads * m.head_dim
    casts = lay.casts  # autocast: one cast of the norm's output per projection reading it
    gathered = c * (3 if casts else 1) * h
    if m.attention_sinks:  # the eager sink kernel's inputs and weights; wo reads its output
        split = c * q + sink_attention_bytes(m, lay)
    elif math_attention(
        m, lay
    ):  # q and k, v repeated to every head, the weights, in fp32; wo reads a copy of the output
        split = c * q + FP32 * (3 * q + m.n_heads * lay.seq_len)
    else:
        split = c * (2 * q + 2 * kv) + FP32 * m.n_heads
    if m.attention_output_gate:  # the gates' sigmoid and the gated output wo reads (the product keeps both factors)
        split += c * 2 * q
        # QK-norm keeps its input, the queries: a view of wq's output, whose storage holds the gates too
        split += c * q if m.qk_norm else 0
    if m.qk_norm:
        split += (c + FP32) * (q + kv) + FP32 * (m.n_heads + m.kv_heads)
    split += 2 * norm_bytes(m, lay)
    gated = 2 if casts else 1
    if m.is_moe_layer(layer):
        k, shared = m.moe_top_k, m.moe_shared_experts * m.expert_ffn_dim
        # Under tp every rank routes all of the layer's tokens (engine/parallel/tp.py); only the experts'
        # hidden units (routed and shared) are split.
        moe = FP32 * (h + 2 * m.num_experts) + c * k * (2 * h + 1) + c * k * 4 * m.expert_ffn_dim // tp
        moe += 2 * INT64 * k + (c * gated * h + c * 4 * shared // tp if shared else 0)
        moe += FP32 * (k + 1) if m.moe_router == "softmax_topk_renorm" else 0
        return tokens * (gathered + split // tp) + tokens * moe + window_bytes(m, lay)
    gathered += c * gated * h
    split += c * 4 * m.ffn_dim + context_parallel_bytes(m, lay)
    return tokens * gathered + tokens * split // tp + window_bytes(m, lay)


def context_parallel_bytes(m: ModelConfig, lay: ActivationLayout) -> int:
    """What a cp attention core (engine/parallel/context.py) saves beyond the local q, k, v and output, per
    local token (÷ tp like the rest of attention): allgather keeps the gathered K and V of the other cp−1
    ranks; ring keeps the K/V blocks it received and each step's partial output and log-sum-exp (fp32), its
    attention weights being recomputed; ulysses keeps its head-sharded whole-sequence q, k, v, the same bytes
    as the local ones."""
    cp = lay.cp
    kv, c = m.kv_heads * m.head_dim, lay.compute
    if cp == 1 or lay.cp_method == "ulysses":
        return 0
    received = c * 2 * kv * (cp - 1)
    if lay.cp_method == "allgather":
        return received
    return received + FP32 * (m.attention_dim + m.n_heads) * cp


def checkpointed_block_bytes(m: ModelConfig, lay: ActivationLayout, layer: int, tokens: int, mode: str) -> int:
    """Saved bytes per block and rank under activation checkpointing. full: only the block's input (the
    residual stream, sequence parallel under tp). selective (assumed policy: keep the outputs of every
    matmul and of SDPA, recompute norms, RoPE and the activation function): the input plus q (with the output
    gate's rows), k, v, SDPA's output and logsumexp (the sink kernel: its output and scores), and the outputs
    of wo, w1, w3 and w2."""
    tp, h, c, r = lay.tp, m.dim, lay.compute, lay.residual
    if mode == "full":
        return tokens * r * h // tp
    kv, f = m.kv_heads * m.head_dim, m.ffn_dim if not m.is_moe_layer(layer) else m.moe_top_k * m.expert_ffn_dim
    wq = m.attention_dim * (2 if m.attention_output_gate else 1)
    # the sink kernel is two bmm's: its scores [heads, seq, keys] are kept, and it has no logsumexp
    core = c * m.n_heads * lay.seq_len if m.attention_sinks else FP32 * m.n_heads
    return tokens * (r * h + c * (wq + m.attention_dim + 2 * h + 2 * kv + 2 * f) + core) // tp


def mtp_bytes(m: ModelConfig, lay: ActivationLayout, tokens: int) -> int:
    """What the multi-token-prediction modules (engine/model/mtp.py) save on the rank computing the loss.
    Each module runs over the whole window (Transformer.mtp_outputs): its hidden input's norm (1/rms only:
    the input is the previous module's block output or the main model's, which their final norms keep), the
    embedding's norm, the projection's input (the concatenated norms, c·2h), a dense block
    (`block_activation_bytes`), its final norm; its loss covers the seq_len − k positions it predicts: the
    head's input over the whole window (c·h), the labels (a copy of their shifted view) and the fp32
    log-probabilities [tokens, vocab], or, chunked, the hidden states' and the whole head's gradients. Under
    tensor parallelism the norms are sequence parallel (÷ tp), the projection and the head read the gathered
    sequence, the log-probabilities are vocabulary-parallel (÷ tp) and the chunked loss projects every
    token through this rank's head rows, as `engine.parallel.memory.loss_activation_bytes` counts the main
    model's. (Under CPU autocast the module's block and final norm see inputs in the compute dtype;
    tests/parallel/test_memory_estimate.py measures the estimate at 0.97-1.0 of what is saved.)"""
    h, c, tp = m.dim, lay.compute, lay.tp
    dense = m.model_copy(update={"num_experts": 0})
    vocab = lay.loss_vocab or -(-m.vocab_size // tp)
    module = tokens * (FP32 + 2 * norm_bytes(m, lay)) // tp + tokens * c * 2 * h
    module += block_activation_bytes(dense, lay, 0, tokens)
    total = 0
    for k in range(1, m.mtp_depth + 1):
        n = tokens * (lay.seq_len - k) // lay.seq_len
        total += module
        if lay.chunked_loss:
            total += n * lay.residual * h + FP32 * vocab * h
        else:
            total += tokens * c * h + n * (INT64 + FP32 * vocab)
    return total
