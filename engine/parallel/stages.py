"""How a model is cut into pipeline stages, torch-free: the pipeline itself (engine/parallel/pipeline.py), the
memory estimate of `forge validate-config` (engine/parallel/memory.py) and the config's rules all use this rule."""

from __future__ import annotations

from engine.errors import UserError

# Model chunks ("virtual stages") each pipeline rank runs under each schedule: stage s runs on rank s % pp.
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}


def stages_per_rank(schedule: str) -> int:
    """Model chunks each pipeline rank holds: 2 for `interleaved_1f1b` (rank r runs stages r and r + pp), 1 for
    `gpipe` and `1f1b`."""
    if schedule not in STAGES_PER_RANK:
        raise UserError(f"unknown pipeline schedule {schedule!r}", f"use one of {', '.join(STAGES_PER_RANK)}")
    return STAGES_PER_RANK[schedule]


def last_stage_cost(mtp_depth: int) -> int:
    """What the last stage runs besides its blocks, in blocks: the output head with its norm (one), and per
    multi-token-prediction module (engine/model/mtp.py) its block and the head once more (two)."""
    return 1 + 2 * mtp_depth


def stage_layer_counts(n_layers: int, n_stages: int, last_cost: int = 1) -> list[int]:
    """How many consecutive blocks each stage gets, balancing cost where the embedding (first stage) costs
    one block and the last stage's head (and prediction modules) `last_cost` blocks (`last_stage_cost`).

    Rule: every stage first gets one block; each remaining block goes to the stage whose cost (blocks, + 1 if
    first, + last_cost if last) is lowest at that moment; ties go to the stage with fewer blocks, then the
    earlier one. This minimises the most expensive stage: 8 blocks over 4 stages → [2, 2, 2, 2] (costs 3, 2,
    2, 3), 6 over 4 → [1, 2, 2, 1], 4 over 2 → [2, 2]; with two prediction modules (last_cost 5) 4 over 2 →
    [3, 1].
    """
    if not 1 <= n_stages <= n_layers:
        raise UserError(
            f"cannot cut {n_layers} layers into {n_stages} pipeline stages: every stage needs at least one layer",
            "lower distributed.pp, use a non-interleaved schedule, or add layers",
        )
    counts = [1] * n_stages
    extra = [0] * n_stages
    extra[0] += 1
    extra[-1] += last_cost
    for _ in range(n_layers - n_stages):
        cheapest = min(range(n_stages), key=lambda s: (counts[s] + extra[s], counts[s], s))
        counts[cheapest] += 1
    return counts


def stage_layers(n_layers: int, n_stages: int, mtp_depth: int = 0) -> list[range]:
    """The blocks of each stage, in order (`stage_layer_counts` consecutive blocks each), for a model with
    `mtp_depth` prediction modules on its last stage."""
    layers, start = [], 0
    for count in stage_layer_counts(n_layers, n_stages, last_stage_cost(mtp_depth)):
        layers.append(range(start, start + count))
        start += count
    return layers
