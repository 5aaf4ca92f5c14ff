"""The cross-section rules of the parallel layouts (engine/parallel/): the degrees against the world size and
the model's shape, what tensor, pipeline, expert and context parallelism each need and do not support yet,
what compiling an MoE model allows; and the warning for a dp_shard written in the seed schema's convention.

Torch-free, like every room's rules module: it imports engine.config's sections and helpers and the
torch-free parallel/stages.py and parallel/compile_plan.py only (`JobConfig` for its types alone), and
engine/plan/checks.py runs these functions in the order it lists.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from engine.config.fields import changed_fields
from engine.errors import ConfigIssue
from engine.parallel.compile_plan import moe_compiled_in_regions
from engine.parallel.stages import stages_per_rank

if TYPE_CHECKING:
    from engine.config.job import JobConfig


def compile_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """An MoE model compiled around its routed experts (`moe_compiled_in_regions`) cannot also checkpoint its
    blocks (engine/parallel/apply.py: check_compilable refuses it again where the model is built)."""
    m, t = cfg.model, cfg.train
    # "auto" is bf16 on the GPUs a layout is planned for; engine.parallel.apply checks again where it runs.
    bf16 = t.mixed_precision in ("bf16", "fp8", "auto")
    if m.is_moe and t.compile_model and t.activation_checkpointing != "none" and moe_compiled_in_regions(cfg, bf16):
        return [
            ConfigIssue(
                "train.activation_checkpointing",
                f"= {t.activation_checkpointing!r} with train.compile_model = true is not supported for an MoE model "
                "compiled around its routed experts (ep > 1, or compute other than bf16): a checkpointed block "
                "would recompute them differently from its forward",
                'set it to "none", or train.compile_model = false',
            )
        ]
    return []


def layout_issues(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """The parallel degrees against the world size and the model's shape."""
    m, d = cfg.model, cfg.distributed
    if world_size < 1:
        return [ConfigIssue("world_size", f"must be >= 1, got {world_size}")]
    issues: list[ConfigIssue] = []
    dp_shard = d.resolved_dp_shard(world_size)
    degrees = f"dp_replicate={d.dp_replicate} × dp_shard={d.dp_shard} × tp={d.tp} × pp={d.pp} × cp={d.cp}"
    # (ep is not a factor: the experts are split over ep of the dp_shard ranks)
    if d.dp_shard == 0 or d.dp_shard < -1:
        issues.append(ConfigIssue("distributed.dp_shard", f"must be -1 or >= 1, got {d.dp_shard}"))
    elif dp_shard == 0 or d.dp_replicate * dp_shard * d.tp * d.pp * d.cp != world_size:
        issues.append(
            ConfigIssue(
                "distributed",
                f"{degrees} does not multiply to the world size {world_size}",
                "make the product of the degrees equal the number of processes",
            )
        )
    if m.n_heads % d.tp or m.kv_heads % d.tp:
        issues.append(
            ConfigIssue(
                "distributed.tp",
                f"n_heads ({m.n_heads}) and n_kv_heads ({m.kv_heads}) must be divisible by tp ({d.tp})",
                f"use a tp that divides both: {', '.join(map(str, divisors(math.gcd(m.n_heads, m.kv_heads))))}",
            )
        )
    if d.pp > m.n_layers:
        issues.append(
            ConfigIssue(
                "distributed.pp",
                f"pp ({d.pp}) exceeds model.n_layers ({m.n_layers})",
                f"use at most {m.n_layers} pipeline stages: each holds at least one block",
            )
        )
    if d.tp > 1:
        issues += tensor_parallel_issues(cfg)
    if d.pp > 1:
        issues += pipeline_issues(cfg)
    if d.ep > 1:
        issues += expert_parallel_issues(cfg, dp_shard)
    issues += context_parallel_issues(cfg)
    return issues


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def context_parallel_issues(cfg: JobConfig) -> list[ConfigIssue]:
    """Context parallelism splits every sequence into 2·cp chunks (head-tail), whose halves tensor
    parallelism splits again, and does not compose with pipelines, mixture-of-experts routing, a sliding
    window or attention sinks yet."""
    m, t, d = cfg.model, cfg.train, cfg.distributed
    if d.cp == 1:
        if "cp_method" in changed_fields(d, ["cp_method"]):
            return [ConfigIssue("distributed.cp_method", "is set, but distributed.cp = 1", "set distributed.cp > 1")]
        return []
    issues = []
    if t.seq_len % (2 * d.cp) or (t.seq_len // d.cp) % d.tp:
        issues.append(
            ConfigIssue(
                "train.seq_len",
                f"{t.seq_len} must be divisible by 2 × distributed.cp ({2 * d.cp}), and each rank's "
                f"{t.seq_len} / cp positions by distributed.tp ({d.tp}): the sequence is cut into 2·cp "
                "chunks, two per cp rank",
                f"use a multiple of {2 * d.cp * d.tp}",
            )
        )
    group = d.cp * d.tp
    if d.cp_method == "ulysses" and (m.n_heads % group or m.kv_heads % group):
        issues.append(
            ConfigIssue(
                "distributed.cp_method",
                f"ulysses splits the heads over the cp ranks: n_heads ({m.n_heads}) and n_kv_heads "
                f"({m.kv_heads}) must be divisible by tp × cp ({group})",
                'use cp_method = "allgather" or "ring", or change the heads',
            )
        )
    for applies, field, what in [
        (d.pp > 1, "distributed.pp", "pipeline parallelism (the stages would pass sequence-sharded activations)"),
        (m.is_moe, "model.num_experts", "MoE models (the routers' sequence statistics would see part of a sequence)"),
        (
            m.sliding_window is not None,
            "model.sliding_window",
            f"sliding-window attention (model.sliding_window = {m.sliding_window}: its cores attend over whole "
            "chunks of keys)",
        ),
        (
            m.attention_sinks,
            "model.attention_sinks",
            "attention sinks (model.attention_sinks: its cores' softmax has no sink logit)",
        ),
    ]:
        if applies:
            issues.append(
                ConfigIssue(
                    field,
                    f"context parallelism (distributed.cp = {d.cp}) does not support {what} yet",
                    "use distributed.cp = 1 for this run",
                )
            )
    return issues


def tensor_parallel_issues(cfg: JobConfig) -> list[ConfigIssue]:
    """What tensor parallelism (with sequence parallelism) needs of the model and the run."""
    m, t, tp = cfg.model, cfg.train, cfg.distributed.tp
    issues = []
    if m.ffn_dim % tp:
        issues.append(
            ConfigIssue(
                "distributed.tp",
                f"the FFN width ({m.ffn_dim}) must be divisible by tp ({tp})",
                "set model.ffn_hidden_dim to a multiple of tp, or change tp",
            )
        )
    if t.seq_len % tp:
        issues.append(
            ConfigIssue(
                "train.seq_len",
                f"{t.seq_len} must be divisible by distributed.tp ({tp}): "
                "sequence parallelism splits the positions over the tensor-parallel ranks",
                f"use a multiple of {tp}",
            )
        )
    if m.is_moe and m.expert_ffn_dim % tp:
        issues.append(
            ConfigIssue(
                "distributed.tp",
                f"the experts' width ({m.expert_ffn_dim}) must be divisible by tp ({tp}): each expert's "
                "hidden units are split over the tensor-parallel ranks",
                "change model.moe_expert_ffn_multiplier or model.ffn_hidden_dim, or tp",
            )
        )
    if m.is_moe and not m.moe_packed_experts:
        issues.append(
            ConfigIssue(
                "model.moe_packed_experts",
                "distributed.tp > 1 with an MoE model needs packed experts (one tensor per projection, "
                "split over the hidden units)",
                "set model.moe_packed_experts = true",
            )
        )
    if t.mixed_precision == "fp8" and t.fp8_recipe != "tensorwise":
        issues.append(
            ConfigIssue(
                "train.fp8_recipe",
                f"{t.fp8_recipe!r} with distributed.tp > 1 is not supported: a row-parallel layer's input is split "
                "along the rows its per-row scales would span, and no parity with one process was measured",
                'use fp8_recipe = "tensorwise" with tensor parallelism',
            )
        )
    return issues


def pipeline_issues(cfg: JobConfig) -> list[ConfigIssue]:
    """What pipeline parallelism needs: a stage per layer at most, micro-batches its schedule accepts, and
    none of what it does not support yet."""
    m, t, d = cfg.model, cfg.train, cfg.distributed
    stages = d.pp * stages_per_rank(d.pp_schedule)
    issues = []
    if stages > m.n_layers:
        issues.append(
            ConfigIssue(
                "distributed.pp",
                f"pp = {d.pp} with pp_schedule = {d.pp_schedule!r} cuts the model "
                f"into {stages} stages, but model.n_layers = {m.n_layers}: every stage needs a layer",
                "lower distributed.pp, use gpipe or 1f1b, or add layers",
            )
        )
    if d.pp_schedule == "1f1b" and t.grad_accum_steps < d.pp:
        issues.append(
            ConfigIssue(
                "train.grad_accum_steps",
                f"{t.grad_accum_steps} pipeline micro-batches are fewer "
                f"than distributed.pp = {d.pp}, which pp_schedule = '1f1b' needs",
                f"set train.grad_accum_steps >= {d.pp} (and halve train.batch_size to keep the batch)",
            )
        )
    rounds = max(1, t.grad_accum_steps // d.pp)
    if d.pp_schedule == "interleaved_1f1b" and t.grad_accum_steps % rounds:
        issues.append(
            ConfigIssue(
                "train.grad_accum_steps",
                f"interleaved_1f1b runs the {t.grad_accum_steps} "
                f"micro-batches in {rounds} rounds (grad_accum_steps // distributed.pp), which "
                "must divide them evenly",
                f"use a multiple of {d.pp}, or fewer than {2 * d.pp}",
            )
        )
    if cfg.eval.enabled and isinstance(cfg.eval.steps, int) and cfg.eval.steps % t.grad_accum_steps:
        issues.append(
            ConfigIssue(
                "eval.steps",
                f"eval.steps = {cfg.eval.steps} must be a multiple of "
                f"train.grad_accum_steps = {t.grad_accum_steps}: evaluation runs through the "
                "pipeline schedule, one pass per grad_accum_steps batches (its micro-batches)",
                f"set eval.steps to a multiple of {t.grad_accum_steps}",
            )
        )
    if m.is_moe and m.moe_router == "sigmoid_topk" and t.activation_checkpointing == "full":
        issues.append(
            ConfigIssue(
                "train.activation_checkpointing",
                f"'full' with distributed.pp = {d.pp} and model.moe_router = 'sigmoid_topk' would route "
                "differently in backward than in forward: a pipeline stage runs later micro-batches' "
                "forwards, which move the routers' balancing bias, before an earlier one's backward, whose "
                "full recomputation would then choose experts with the new bias",
                'use train.activation_checkpointing = "selective" (it keeps the routing decisions) or "none"',
            )
        )
    unsupported = [
        (
            t.loss_fn == "chunked_cross_entropy" and d.tp > 1,
            "train.loss_fn",
            f"chunked cross-entropy with distributed.tp = {d.tp}: the last stage would hand the loss its "
            "sequence-sharded hidden states",
            'set train.loss_fn = "cross_entropy" (the same loss, computed from the logits), or distributed.tp = 1',
        ),
        (
            t.mixed_precision == "fp16",
            "train.mixed_precision",
            "fp16 loss scaling",
            'use train.mixed_precision = "bf16", or distributed.pp = 1',
        ),
    ]
    for applies, field, what, fix in unsupported:
        if applies:
            issues.append(
                ConfigIssue(field, f"pipeline parallelism (distributed.pp = {d.pp}) does not support {what} yet", fix)
            )
    return issues


def expert_parallel_issues(cfg: JobConfig, dp_shard: int) -> list[ConfigIssue]:
    """Expert parallelism: experts split over ep of the dp_shard ranks, for MoE models in the layouts it is
    tested with."""
    m, d, ep = cfg.model, cfg.distributed, cfg.distributed.ep
    if not m.is_moe:
        return [
            ConfigIssue(
                "distributed.ep",
                f"ep = {ep} needs a mixture-of-experts model (model.num_experts > 0)",
                "set distributed.ep = 1, or model.num_experts",
            )
        ]
    issues = []
    if m.num_experts % ep:
        issues.append(
            ConfigIssue("distributed.ep", f"model.num_experts = {m.num_experts} is not divisible by ep = {ep}")
        )
    if dp_shard and dp_shard % ep:
        issues.append(
            ConfigIssue(
                "distributed.ep",
                f"ep = {ep} must divide dp_shard = {dp_shard}: the experts are split over data-parallel shard ranks",
                "choose ep among the divisors of dp_shard",
            )
        )
    if not m.moe_packed_experts:
        issues.append(
            ConfigIssue(
                "model.moe_packed_experts",
                "distributed.ep > 1 needs packed experts (one tensor per projection, split over the expert dimension)",
                "set model.moe_packed_experts = true",
            )
        )
    if m.moe_gradient_scale:
        issues.append(
            ConfigIssue(
                "model.moe_gradient_scale",
                "is not supported with distributed.ep > 1 yet",
                "set it to false, or distributed.ep = 1",
            )
        )
    if d.cp > 1:
        issues.append(
            ConfigIssue(
                "distributed.cp",
                "is not supported with expert parallelism (distributed.ep > 1) yet",
                "use distributed.ep = 1 for this",
            )
        )
    return issues


def layout_warnings(cfg: JobConfig, world_size: int) -> list[ConfigIssue]:
    """A dp_shard that fills the world only with ep counted in it, as the seed schema writes it: it runs, read
    that way, and the warning says how Forge writes it."""
    d = cfg.distributed
    if d.seed_ep_convention(world_size):
        return [
            ConfigIssue(
                "distributed.dp_shard",
                f"{d.dp_shard} × ep {d.ep} × the other degrees fill the world size {world_size}: read as the seed "
                f"schema's convention (ep a factor of the world size), i.e. FSDP over {d.dp_shard * d.ep} ranks "
                f"with the experts split over {d.ep} of them",
                f"write distributed.dp_shard = {d.dp_shard * d.ep} (or -1) to say it the Forge way",
            )
        ]
    return []
