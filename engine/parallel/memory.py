"""Per-rank memory of a training layout, from the config alone: no torch, no model (70B answers instantly).

`forge validate-config --world-size N` prints this so a user sees whether a layout fits before submitting.
One row per pipeline rank, since ranks differ by stage (the first stage holds the embedding, the last the
final norm, the output head and the logits, and earlier stages hold more microbatches in flight); all
the ranks of one pipeline rank (across dp, tp, cp) hold the same amount.

What is counted, per rank (bytes):

The model enters only through its family's `ModelSpec` (engine/model/spec.py): its parameter tensors
(`ParamSpec`: shape, owner, the dimension tensor parallelism shards), what its blocks save for backward and
its position tables; the optimizer through its registered `OptimizerState`.

- params: fp32 master weights (bf16 with `optimizer.weight_dtype = "bf16"`, and then so are the gradients).
  Each tensor is first divided by tp along the dimension tensor parallelism shards (as the family's spec says: e.g. attention wq/wk/wv and MLP w1/w3 by rows, wo/w2 by columns, the
  embedding and the output head by vocabulary rows, MoE experts by hidden units; norms and routers stay
  whole), then FSDP2 shards dim 0 over dp_shard × cp ranks, padding it to a multiple (ceil(rows / shards)
  rows per rank). Tied embeddings count once.
- grads: the same shapes in fp32 (FSDP2 reduce-scatters in fp32, the sharded gradients match the params),
  except the untied embedding's under tensor parallelism without FSDP, which DTensor returns whole (`grad_numel`).
- optimizer: the state the chosen optimizer registered (`OptimizerState` in engine/config/optimizer.py, or
  the one `optimizer.state_dtype` / `weight_dtype` select, `optimizer_state`:
  bytes per element of each trained parameter, by parameter kind where they differ, and per tensor). With
  `train.ema_decay`, the EMA of the weights adds a copy of the params here (fp32, sharded like them).
- host: what `train.activation_offload` keeps in host memory instead of the device (`stage_offloaded_bytes`);
  with `distributed.cpu_offload`, the params, grads and optimizer state too (their columns are then 0: FSDP2
  keeps the shards, their gradients and the optimizer's state on the host, and the optimizer steps there),
  while the device keeps FSDP2's gathered copies and unsharded gradients of the running units (buffers).
- activations: what autograd keeps from forward to backward (see `layer_activation_bytes`; packed documents'
  masks, `packing_bytes`), for the
  micro-batches a rank has in flight (`forward_chunks`): one without pipelining (accumulation steps run one
  after another); with pp, as many as the pipeline schedule holds before its first backward.
- buffers: transient memory at the peak: FSDP2's unsharded copies (see `buffer_bytes`), autocast's
  low-precision weight copies when nothing is sharded, the loss's [tokens, vocab] gradients, the whole
  matrices an optimizer's step holds (`OptimizerState.step_copies`).

The total (`StageMemory.total`) is params + optimizer + buffers + activations + grads, except that with one
micro-batch per step only the larger of activations and grads counts (backward frees the one as it makes
the other). On an H100 (torch 2.11; a 0.49B model, 8 blocks of dim 2048, batch 4 × 2048 tokens, one GPU)
it came within −3 … +8 % of torch.cuda.max_memory_allocated() over bf16/fp32, no/full activation
checkpointing, accumulation, the Adam and orthogonalizing optimizers, QK-norm, MoE, and FSDP2 on one rank. It ignores the CUDA context
(~0.5–1 GiB), the caching allocator's fragmentation and NCCL buffers: leave ~10–15 % headroom.
Assumptions, as engine.parallel builds a run: with data parallelism (dp_replicate × dp_shard > 1) or
`distributed.cpu_offload`, FSDP2 with
MixedPrecisionPolicy(param_dtype=compute dtype, reduce_dtype=fp32) and no autocast; without it, autocast
over fp32 weights (the residual stream stays fp32); sequence parallelism with tp; "auto" precision
estimated as bf16 (a GPU run). `compile_model` is counted as eager: a compiled graph saves no more than the
eager ops it replaces, and MoE blocks compiled in regions (ep > 1, or not bf16) keep their routed experts,
with the rows the all-to-all brings (k per token on average), eager and counted as such.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from engine.config.job import JobConfig
from engine.config.model import ModelConfig
from engine.config.optimizer import optimizer_state
from engine.config.optimizer import weight_bytes as trained_weight_bytes
from engine.data.batch_plan import accumulation
from engine.model.packed_kernel import FLEX_BLOCK, packed_attention_backend
from engine.model.spec import ActivationLayout, ParamSpec, spec_for
from engine.parallel.lora_memory import trains, weight_bytes, with_adapters
from engine.parallel.stages import stage_layers, stages_per_rank

FP32 = 4
INT64 = 8
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2, "auto": 2}
"""Bytes per element of matmul inputs/outputs under each `train.mixed_precision` (fp8 keeps bf16 activations;
auto = bf16, as on the GPUs a layout is planned for)."""


@dataclass(frozen=True)
class StageMemory:
    """Bytes one rank of pipeline rank `pp_rank` holds. It runs pipeline `stages` (two with interleaved_1f1b),
    whose blocks are `blocks` (first, last) inclusive, one pair per stage; `microbatches_in_flight` is the
    most stage forwards whose activations it holds at once."""

    pp_rank: int
    stages: tuple[int, ...]
    blocks: tuple[tuple[int, int], ...]
    microbatches_in_flight: int
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    grads_persist: bool
    """Whether gradients live through the forward passes (accumulated over micro-batches, or pipelined)."""
    host: int = 0
    """Bytes this rank keeps in host memory instead (`train.activation_offload`'s saved activations, and with
    `distributed.cpu_offload` its params, grads and optimizer state); not in `total`, which is the device's."""

    @property
    def total(self) -> int:
        """The estimated peak: gradients and activations add up only when gradients persist; with one
        micro-batch per step, backward frees activations as it creates gradients, so the larger counts."""
        live = self.grads + self.activations if self.grads_persist else max(self.grads, self.activations)
        return self.params + self.optimizer + live + self.buffers

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "total": self.total}


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Every parameter tensor of the model of `cfg`, in registration order, as its family lists them."""
    return spec_for(cfg).param_specs(cfg)


def local_numel(spec: ParamSpec, tp: int, fsdp: int) -> int:
    """Elements the fullest rank holds: divided by tp along `tp_dim` (ceil, as DTensor's Shard gives the
    first ranks the remainder), then dim 0 split over `fsdp` ranks with FSDP2's padding (every rank gets
    ceil(rows / fsdp) rows)."""
    shape = list(spec.shape)
    if spec.tp_dim is not None:
        shape[spec.tp_dim] = math.ceil(shape[spec.tp_dim] / tp)  # the vocabulary may shard unevenly
    shape[0] = math.ceil(shape[0] / fsdp)
    return math.prod(shape)


def grad_numel(cfg: JobConfig, spec: ParamSpec, local: int) -> int:
    """Elements of a parameter's gradient on this rank: those of the parameter, except for the untied embedding
    under tensor parallelism with no FSDP to reduce-scatter it: DTensor's embedding backward hands back a
    replicated gradient of the whole table (measured in tests/parallel/test_memory_estimate.py)."""
    d = cfg.distributed
    whole = spec.owner == "embedding" and not cfg.model.tie_embeddings and d.tp > 1
    return math.prod(spec.shape) if whole and d.dp_replicate * d.dp_shard * d.cp == 1 else local


def optimizer_state_bytes(cfg: JobConfig, spec: ParamSpec, local: int) -> int:
    """Bytes of the optimizer's state for one parameter holding `local` elements on this rank."""
    return optimizer_state(cfg.optimizer).bytes(spec.kind, local)


def checkpoint_bytes(cfg: JobConfig) -> int:
    """Bytes of one checkpoint on disk, whatever the layout: DCP writes every element of the fp32 weights and
    the optimizer state once (a shard per rank, a replicated tensor by one rank), and the fp32 EMA of the
    weights with `train.ema_decay`. The train state and DCP's metadata add a few tens of kilobytes."""
    weight_copies = 2 if cfg.train.ema_decay else 1
    w = trained_weight_bytes(cfg.optimizer)
    return sum(w * weight_copies * s.numel + optimizer_state_bytes(cfg, s, s.numel) for s in param_specs(cfg.model))


def forward_chunks(cfg: JobConfig, pp_rank: int) -> list[int]:
    """The local stage (0 or 1) of each stage forward whose activations rank `pp_rank` holds at its peak,
    as torch.distributed.pipelining schedules them with grad_accum_steps microbatches: none without
    pipelining but the one micro-batch running; gpipe every microbatch; 1F1B the min(microbatches,
    pp − rank) of its warm-up; interleaved 1F1B its warm-up (pp·(2 − 1) + 2·(pp − 1 − rank) forwards,
    capped at 2·microbatches) plus one, going through its stages in rounds of pp microbatches."""
    d, accum = cfg.distributed, cfg.train.grad_accum_steps
    if d.pp == 1:
        return [0]
    if d.pp_schedule == "gpipe":
        return [0] * accum
    if d.pp_schedule == "1f1b":
        return [0] * min(accum, d.pp - pp_rank)
    per_round = accum // max(1, accum // d.pp)
    warmup = min(per_round + 2 * (d.pp - 1 - pp_rank), 2 * accum)
    return [(i // per_round) % 2 for i in range(min(warmup + 1, 2 * accum))]


def uses_fsdp(cfg: JobConfig) -> bool:
    """FSDP2 is applied whenever there is data parallelism (engine.parallel.mesh: HSDP with dp_replicate), and
    with `distributed.cpu_offload` on one process too; it gathers the weights in the compute dtype, and the
    trainer then runs without autocast."""
    d = cfg.distributed
    return d.dp_replicate * d.dp_shard > 1 or d.cpu_offload


def residual_bytes(cfg: JobConfig) -> int:
    """Bytes per element of the residual stream: fp32 under autocast (fp32 weights, fp32 embedding), the
    compute dtype under FSDP2 (the weights themselves are gathered in it)."""
    if uses_fsdp(cfg) or bf16_weights(cfg):
        return COMPUTE_BYTES[cfg.train.mixed_precision]
    return FP32


def bf16_weights(cfg: JobConfig) -> bool:
    """optimizer.weight_dtype = "bf16": the weights themselves are bf16 (the residual stream is too, and autocast
    makes no low-precision copies of them)."""
    return trained_weight_bytes(cfg.optimizer) < FP32


def activation_layout(cfg: JobConfig) -> ActivationLayout:
    """What a family's saved activations depend on besides the model: the compute and residual-stream bytes,
    autocast's per-projection casts (compute below fp32 and no FSDP), and the tp/cp layout."""
    c, d = COMPUTE_BYTES[cfg.train.mixed_precision], cfg.distributed
    return ActivationLayout(
        compute=c,
        residual=residual_bytes(cfg),
        casts=c < FP32 and not uses_fsdp(cfg) and not bf16_weights(cfg),
        tp=d.tp,
        cp=d.cp,
        cp_method=d.cp_method,
        seq_len=cfg.train.seq_len,
        packed=cfg.data.pack_sequences,
        chunked_loss=cfg.train.loss_fn == "chunked_cross_entropy",
        loss_vocab=loss_vocab(cfg),
    )


def loss_vocab(cfg: JobConfig) -> int:
    """Vocabulary entries per rank the loss computes over: the head's shard under tensor parallelism (loss
    parallel, or the chunked loss's own shard), but the whole vocabulary under pipeline parallelism, whose last
    stage gathers the logits for the schedule's loss (engine/parallel/tp.py, `uses_loss_parallel`)."""
    m, d = cfg.model, cfg.distributed
    if d.pp > 1 and cfg.train.loss_fn == "cross_entropy":
        return m.vocab_size
    return math.ceil(m.vocab_size / d.tp)


def layer_activation_bytes(cfg: JobConfig, layer: int, tokens: int) -> int:
    """Bytes autograd saves for block `layer` over `tokens` tokens on one rank, without activation
    checkpointing, as the family counts them (its spec's `block_activation_bytes`)."""
    return spec_for(cfg.model).block_activation_bytes(cfg.model, activation_layout(cfg), layer, tokens)


def checkpointed_layer_bytes(cfg: JobConfig, layer: int, tokens: int) -> int:
    """Saved bytes of block `layer` per rank under `train.activation_checkpointing` (full or selective)."""
    mode, m = cfg.train.activation_checkpointing, cfg.model
    return spec_for(m).checkpointed_block_bytes(m, activation_layout(cfg), layer, tokens, mode)


def loss_activation_bytes(cfg: JobConfig, tokens: int) -> int:
    """Saved by the final norm, the head and the loss on one rank (and what the family saves beyond them
    there, its spec's `head_extra_bytes`). The final norm is sequence parallel
    (÷ tp); the head reads the whole sequence. cross_entropy keeps the fp32 log-probabilities
    [tokens, vocab/tp] (vocabulary-parallel head; the whole vocabulary on a pipeline's last stage,
    `loss_vocab`), and the fp32 logits too with z-loss;
    chunked_cross_entropy keeps the gradients it computes in forward: the hidden states' (their dtype, all the
    tokens: under tp every rank projects the gathered sequence) and its head rows' (fp32, vocab/tp of them)."""
    m, t, tp = cfg.model, cfg.train, cfg.distributed.tp
    saved = tokens * spec_for(m).norm_bytes(m, activation_layout(cfg)) // tp
    saved += spec_for(m).head_extra_bytes(m, activation_layout(cfg), tokens)
    if t.loss_fn == "chunked_cross_entropy":
        return saved + tokens * residual_bytes(cfg) * m.dim + FP32 * loss_vocab(cfg) * m.dim
    saved += INT64 * tokens  # the labels
    logits = FP32 * tokens * loss_vocab(cfg) * (2 if t.z_loss_weight else 1)
    return saved + COMPUTE_BYTES[t.mixed_precision] * tokens * m.dim + logits


def buffer_bytes(cfg: JobConfig, stage: list[ParamSpec], tokens: int, has_head: bool) -> int:
    """Transient memory at the peak, beyond the saved activations.

    - FSDP2 (`uses_fsdp`, engine.parallel.apply.apply_fsdp): the compute-dtype copies of two gathered blocks
      (the one running and the one prefetched; the last block stays gathered into backward), a block's
      unsharded gradients in the compute dtype and in fp32 for the reduce-scatter, and the root's weights
      (embedding, final norm, head), gathered through all of forward and of backward. Under pipeline
      parallelism nothing is resharded: all of the stage's weights stay gathered through the step.
    - no FSDP, compute dtype below fp32: autocast's low-precision copies of the matmul weights, which
      autograd keeps until backward (with activation checkpointing, only the recomputed block's and the head's).
    - the loss's gradients: two fp32 [tokens, vocab/tp] tensors in backward for cross_entropy, two
      [ce_chunk_size, vocab/tp] chunks in forward for chunked_cross_entropy (its head gradient is an
      activation); vocab/tp is `loss_vocab`.
    - the optimizer's step: `OptimizerState.step_copies` fp32 copies of the largest whole parameter of a
      kind (a matrix orthogonalized after gathering it from its shards, its iterate and the result).
    """
    d, t, m = cfg.distributed, cfg.train, cfg.model
    c = COMPUTE_BYTES[t.mixed_precision]
    # What one gathered block holds: the whole of each weight (÷ tp), but under expert parallelism only this
    # rank's experts (their dim 0 ÷ ep; FSDP shards them over the other dp_shard / ep ranks).
    tp_local = {s.name: local_numel(s, d.tp, d.ep if s.expert_parallel else 1) for s in stage}
    blocks: dict[int, int] = {}
    matrices: dict[int, int] = {}  # what autocast casts, per block
    for s in stage:
        if isinstance(s.owner, int):
            blocks[s.owner] = blocks.get(s.owner, 0) + tp_local[s.name]
            matrices[s.owner] = matrices.get(s.owner, 0) + (tp_local[s.name] if len(s.shape) >= 2 else 0)
    largest = sorted(blocks.values(), reverse=True)[:2] or [0]
    total = 0
    if uses_fsdp(cfg):
        ends = sum(tp_local[s.name] for s in stage if not isinstance(s.owner, int))
        gathered = sum(blocks.values()) if d.pp > 1 else sum(largest)
        total += c * (gathered + ends) + (c + FP32) * largest[0]
    elif c < FP32 and not bf16_weights(cfg):
        head = sum(tp_local[s.name] for s in stage if s.owner == "head")
        if has_head and m.tie_embeddings and not any(s.owner == "head" for s in stage):  # (pipelined: a copy)
            # the head is the embedding, which autocast does not cast for the lookup
            head += math.ceil(m.vocab_size / d.tp) * m.dim
        kept = sum(matrices.values()) if t.activation_checkpointing == "none" else max(matrices.values(), default=0)
        total += c * (kept + head)
    if has_head and t.loss_fn == "chunked_cross_entropy":
        total += 2 * FP32 * min(t.ce_chunk_size, tokens) * loss_vocab(cfg)
    elif has_head:
        total += 2 * FP32 * tokens * loss_vocab(cfg)
    for kind, copies in optimizer_state(cfg.optimizer).step_copies.items():
        total += copies * FP32 * max((s.numel for s in stage if s.kind == kind), default=0)
    return total


def estimate_memory(cfg: JobConfig, world_size: int) -> list[StageMemory]:
    """Per-rank memory of each pipeline rank for `cfg`'s layout on `world_size` processes.

    Pure arithmetic on the config; call it on a checked config (`engine.plan.check_config`), whose degrees
    multiply to the world size (`ResolvedJob.memory` is this). The accumulation a global batch implies is
    derived here: the run's length is not needed.
    """
    train = cfg.train.model_copy(update={"grad_accum_steps": accumulation(cfg, world_size)})
    dp_shard = cfg.distributed.resolved_dp_shard(world_size)
    if dp_shard < 1:
        raise ValueError(f"the parallel degrees do not divide the world size {world_size}; validate the config first")
    cfg = cfg.model_copy(
        update={"train": train, "distributed": cfg.distributed.model_copy(update={"dp_shard": dp_shard})}
    )
    d, t, m = cfg.distributed, cfg.train, cfg.model
    specs = with_adapters(param_specs(m), cfg.lora)  # [lora]: frozen base + trained adapters
    per_rank = stages_per_rank(d.pp_schedule) if d.pp > 1 else 1
    n_stages = d.pp * per_rank
    if n_stages > m.n_layers:
        raise ValueError(f"{n_stages} pipeline stages cannot split {m.n_layers} blocks; validate the config first")
    layers = stage_layers(m.n_layers, n_stages, m.mtp_depth)
    tokens = t.batch_size * t.seq_len // d.cp  # one micro-batch on one rank, before sequence parallelism
    rows = []
    for rank in range(d.pp):
        stages = [rank + k * d.pp for k in range(per_rank)]
        owned = [s for stage in stages for s in stage_specs(specs, layers[stage], stage == 0, stage == n_stages - 1)]
        owned += embedding_copy(cfg, specs, stages, n_stages)
        local = {s.name: local_numel(s, d.tp, d.dp_shard * d.cp) for s in owned}
        params = sum(param_bytes(cfg, s, local[s.name]) for s in owned)
        trained = [s for s in owned if trains(s, cfg.lora)]
        chunk = [stage_activation_bytes(cfg, layers[s], tokens, s == 0, s == n_stages - 1) for s in stages]
        chunks = forward_chunks(cfg, rank)
        offloaded = [stage_offloaded_bytes(cfg, layers[s], tokens, s == 0, s == n_stages - 1) for s in stages]
        blocks = [i for s in stages for i in layers[s]]
        rows.append(
            host_offloaded(
                cfg,
                StageMemory(
                    pp_rank=rank,
                    stages=tuple(stages),
                    blocks=tuple((layers[s].start, layers[s].stop - 1) for s in stages),
                    microbatches_in_flight=len(chunks),
                    params=params,
                    grads=trained_weight_bytes(cfg.optimizer) * sum(grad_numel(cfg, s, local[s.name]) for s in trained),
                    optimizer=sum(optimizer_state_bytes(cfg, s, local[s.name]) for s in trained)
                    + (params if t.ema_decay else 0),
                    activations=sum(chunk[local] - offloaded[local] for local in chunks)
                    + recompute_bytes(cfg, blocks, tokens)
                    + packing_bytes(cfg, in_flight=[len(layers[stages[local]]) for local in chunks]),
                    buffers=buffer_bytes(cfg, owned, tokens, has_head=n_stages - 1 in stages)
                    + last_stage_output_bytes(cfg, tokens, [stages[local] for local in chunks], n_stages),
                    grads_persist=t.grad_accum_steps > 1 or d.pp > 1,
                    host=sum(offloaded[local] for local in chunks),
                ),
            )
        )
    return rows


def host_offloaded(cfg: JobConfig, row: StageMemory) -> StageMemory:
    """With `distributed.cpu_offload`, the row with its params, grads and optimizer state (the EMA's copy of
    the weights included, made like them) moved to the host column."""
    if not cfg.distributed.cpu_offload:
        return row
    moved = row.params + row.grads + row.optimizer
    return replace(row, params=0, grads=0, optimizer=0, host=row.host + moved)


def last_stage_output_bytes(cfg: JobConfig, tokens: int, in_flight: list[int], n_stages: int) -> int:
    """Under pipeline parallelism the schedule keeps the last stage's output for each micro-batch in flight (its
    forward done, its backward not yet: `in_flight` lists their stages) beyond what autograd saves: the logits
    [tokens, vocab] in the compute dtype, or with the chunked loss the final-normed hidden states [tokens, dim]
    in the residual's dtype; with multi-token prediction (1 + D) times that (engine/parallel/pipeline.py), and
    once more in backward, where the split of that output into the main and the modules' parts joins their
    gradients into one tensor of its size."""
    t, m = cfg.train, cfg.model
    if cfg.distributed.pp == 1:
        return 0
    if t.loss_fn == "chunked_cross_entropy":
        size = residual_bytes(cfg) * tokens * m.dim
    else:
        size = COMPUTE_BYTES[t.mixed_precision] * tokens * m.vocab_size
    output = (1 + m.mtp_depth) * size
    kept = sum(stage == n_stages - 1 for stage in in_flight)
    return output * kept + (output if m.mtp_depth and kept else 0)


def param_bytes(cfg: JobConfig, spec: ParamSpec, local: int) -> int:
    """Bytes of a parameter's `local` elements: as LoRA stores it (fp32, or an NF4 base), or bf16 with
    optimizer.weight_dtype = "bf16" (which LoRA does not combine with)."""
    if bf16_weights(cfg):
        return trained_weight_bytes(cfg.optimizer) * local
    return weight_bytes(spec, local, cfg.lora)


def embedding_copy(cfg: JobConfig, specs: list[ParamSpec], stages: list[int], n_stages: int) -> list[ParamSpec]:
    """Under pipeline parallelism the last stage's rank holds a second copy of the embedding, with its own
    gradient and optimizer state, as a tied head, or for multi-token prediction's lookups (one copy when
    both: the head and the lookup share it; engine/parallel/pipeline.py)."""
    m = cfg.model
    if not (m.tie_embeddings or m.mtp_depth) or n_stages == 1 or n_stages - 1 not in stages or 0 in stages:
        return []
    embedding_module, head_module = spec_for(m).parts.tied
    [embedding] = [s for s in specs if s.name == f"{embedding_module}.weight"]
    if not m.tie_embeddings:
        return [embedding]
    return [ParamSpec(f"{head_module}.weight", embedding.shape, "head", embedding.tp_dim)]


def packing_bytes(cfg: JobConfig, device_type: str = "cuda", in_flight: list[int] | None = None) -> int:
    """What data.pack_sequences (engine.model.documents) adds to the saved activations of one rank on a device
    type (the estimate is for a GPU run). `in_flight`: for each micro-batch whose activations the rank holds
    at its peak (`forward_chunks`), the number of blocks of the stage it went through; default one micro-batch
    through every block (no pipeline). Each such micro-batch keeps its own RoPE tables (cos and sin
    [batch, local, head_dim] fp32 instead of the one shared [local, head_dim] pair; local = seq / cp) and its
    own mask, which depends on the kernel (engine/model/packed_kernel.py). FlexAttention (CUDA, head_dim >= 16,
    seq_len >= 128): its block mask, made once per forward and shared by every block of the stage, is int32
    block counts [batch, 1, n] and indices [batch, 1, n, n] (n = ⌈seq / 128⌉) for the partial and the full
    blocks, by rows and by columns, while the kernel keeps the same output and logsumexp as flash-style SDPA.
    SDPA with a dense boolean mask (the other cases): each block's SDPA instead keeps the additive
    [batch, 1, seq, seq] mask it makes from it, in the compute dtype: measured equal to the saved tensors'
    bytes on CPU in tests/data/test_packing.py. With activation checkpointing only the block being recomputed
    keeps an additive mask, but the boolean mask itself (one byte an element) stays alive once per micro-batch
    in flight, held by the checkpoints' recomputation arguments rather than saved by autograd. The
    whole sequence and the whole batch of a micro-step on every tp rank (attention runs after the sequence
    gather; the mask has one head); every pipeline stage builds its own from the document ids
    (engine/parallel/pipeline.py). Under cp (never with pp), ulysses attends over the whole sequence with the
    one-process mask (the same terms), allgather and ring build smaller masks per piece
    (`context_parallel_mask_bytes`). The FlexAttention figure equals the bytes of the block mask's tensors
    built on the CPU (tests/data/test_packing.py); what the GPU kernel saves besides is not measured yet (no GPU
    was available)."""
    t, m, d = cfg.train, cfg.model, cfg.distributed
    if not cfg.data.pack_sequences:
        return 0
    in_flight = [m.n_layers] if in_flight is None else in_flight
    rope = 2 * FP32 * (len(in_flight) * t.batch_size - 1) * (t.seq_len // d.cp) * spec_for(m).position_table_width(m)
    blocks = sum(in_flight) if t.activation_checkpointing == "none" else 1
    if d.cp > 1 and d.cp_method != "ulysses":
        return blocks * context_parallel_mask_bytes(cfg) + rope
    if packed_attention_backend(device_type, m.head_dim, t.seq_len) == "sdpa":
        held = 0 if t.activation_checkpointing == "none" else len(in_flight) * t.batch_size * t.seq_len**2
        # SDPA keeps the mask additive in the compute dtype; the sink kernel its boolean negation (1 byte)
        kept = 1 if m.attention_sinks else COMPUTE_BYTES[t.mixed_precision]
        return blocks * kept * t.batch_size * t.seq_len**2 + held + rope
    n = -(-t.seq_len // FLEX_BLOCK)
    return len(in_flight) * 4 * 4 * t.batch_size * (n + n * n) + rope


def context_parallel_mask_bytes(cfg: JobConfig) -> int:
    """What the packed windows' masks add per block under cp allgather or ring (engine/parallel/context.py), on
    any device (neither takes FlexAttention). chunk = seq / 2cp, local = 2·chunk. allgather: each of the
    rank's two query chunks attends the keys up to its end through SDPA with a [batch, 1, chunk, end] mask,
    kept additive in the compute dtype; the two ends add up to (2cp + 1)·chunk on every rank. ring: each
    piece's boolean mask is an input its recomputation keeps, [batch, 1, local, local] for the own block and
    [batch, 1, local, chunk] or [batch, 1, chunk, local] for each of the cp − 1 others; unpacked, the own
    block's causal [local, local] mask is kept already. Measured equal to the saved tensors' bytes on CPU in
    tests/parallel/test_context_parallel.py (where unpacked allgather keeps its lower-right causal masks besides, which
    CUDA's memory-efficient kernel does not build)."""
    t, d = cfg.train, cfg.distributed
    chunk = t.seq_len // (2 * d.cp)
    local = 2 * chunk
    if d.cp_method == "allgather":
        return COMPUTE_BYTES[t.mixed_precision] * t.batch_size * chunk * (2 * d.cp + 1) * chunk
    return t.batch_size * local * (local + (d.cp - 1) * chunk) - local * local


def stage_specs(specs: list[ParamSpec], layers: range, first: bool, last: bool) -> list[ParamSpec]:
    """The parameters a stage owns: its blocks, the embedding on the first, the final norm and head on the last."""
    return [
        s
        for s in specs
        if s.owner in layers or (first and s.owner == "embedding") or (last and s.owner in ("norm", "head", "mtp"))
    ]


def stage_activation_bytes(cfg: JobConfig, layers: range, tokens: int, first: bool, last: bool) -> int:
    """Saved bytes of one micro-batch through one stage on one rank."""
    per_layer = layer_activation_bytes if cfg.train.activation_checkpointing == "none" else checkpointed_layer_bytes
    total = sum(per_layer(cfg, layer, tokens) for layer in layers)
    total += INT64 * tokens if first else 0  # the embedding's token ids
    total += loss_activation_bytes(cfg, tokens) if last else 0
    return total


def recompute_bytes(cfg: JobConfig, layers: list[int], tokens: int) -> int:
    """With activation checkpointing, backward recomputes one block at a time: the largest block's full
    activations exist once on top of the checkpoints. With `train.activation_offload`, backward brings a
    block's saved tensors back from the host as its nodes run: bounded the same way."""
    t = cfg.train
    if t.activation_checkpointing == "none" and not t.activation_offload:
        return 0
    return max(layer_activation_bytes(cfg, layer, tokens) for layer in layers)


def stage_offloaded_bytes(cfg: JobConfig, layers: range, tokens: int, first: bool, last: bool) -> int:
    """What `train.activation_offload` moves to host memory of one micro-batch through one stage: every
    activation autograd saves goes through its saved-tensor hooks (torch.autograd.graph.save_on_cpu), the
    inputs a checkpointed block keeps for its recomputation included (measured on CPU in
    tests/parallel/test_memory_estimate.py); only the recomputation in backward saves through the checkpoint's own
    hooks, on the device (`recompute_bytes`). Packed documents' masks stay counted on the device. Not counted:
    save_on_cpu copies each saved tensor whole, so a second view of a saved storage is a second host copy, and
    the weights a matmul saves (the fp32 parameters without autocast, their low-precision copies with it) are
    copied too."""
    if not cfg.train.activation_offload:
        return 0
    return stage_activation_bytes(cfg, layers, tokens, first, last)
