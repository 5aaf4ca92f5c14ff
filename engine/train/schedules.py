"""Learning-rate schedules as multipliers of `optimizer.lr`, driven by `torch.optim.lr_scheduler.LambdaLR`.

Step s counts optimizer steps from 0. Warmup (when warmup_steps = W > 0) is linear: (s + 1) / (W + 1),
so the first step already trains (at lr / (W + 1)) and step W - 1 reaches W / (W + 1). `wsd` then holds
the peak for `stable_steps` = S steps (the other schedules have S = 0). The decay then runs over
`decay_steps` = D from 1 down to `min_lr_ratio` = m, as m + (1 - m) · shape(p) with progress
p = (s - W - S) / D, and stays at the floor after. By default D = max_steps - W - S - 1, so the last step
(s = max_steps - 1) trains exactly at the floor.

`inv_sqrt` has no decay length: after the warmup it is sqrt(T / (T + k)), k = s - W the steps since the
warmup ended and T = max(warmup_steps, 1); with W >= 1 that is the familiar sqrt(W / max(s, W)).

Warm restarts (`cycles`): the run is cut into cycles at step boundaries b_1 < b_2 < … (a number N of cycles
cuts it into N equal ones at floor(k · max_steps / N)). Cycle k runs steps b_k … b_{k+1} - 1 (the last one to
max_steps - 1) as a whole schedule of its own: its local step is s - b_k, it warms up over `rewarmup_steps`
(`warmup_steps` for the first cycle), and its default decay ends on its own last step. Without `cycles` the
whole run is one cycle and the numbers are exactly those above.

With `scheduler.unit = "tokens"` every length above (warmup_steps, stable_steps, decay_steps, rewarmup_steps)
counts tokens, and the schedule is read at s = the tokens trained on before the step (engine.data.batch_plan:
under a batch ramp steps differ in size). The run's length is then the last step's s + 1, so the default decay
still ends exactly on the last step. `unit = "steps"` (the default) is the schedule above, number for number.

The multipliers are plain Python (no torch), so `forge validate-config` can draw the curve without
importing torch; only `build_scheduler` touches torch.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.config.registry import SCHEDULERS
from engine.config.scheduler import SchedulerConfig
from engine.data.batch_plan import batch_plan
from engine.data.mixture import lr_scale, mixture_phases

if TYPE_CHECKING:
    import torch

    from engine.config.job import JobConfig


def stable_steps(cfg: SchedulerConfig) -> int:
    """Steps the chosen schedule holds the peak between warmup and decay (wsd's stable_steps)."""
    return SCHEDULERS.chosen(cfg).held_steps


def default_decay_steps(cfg: SchedulerConfig, max_steps: int, warmup: int | None = None) -> int:
    """The decay that ends on the last step: max_steps - warmup - stable - 1 (at least 1)."""
    warmup = cfg.warmup_steps if warmup is None else warmup
    return max(max_steps - warmup - stable_steps(cfg) - 1, 1)


def cycle_starts(cfg: SchedulerConfig, max_steps: int) -> list[int]:
    """The 0-based step each cycle begins at: [0] without warm restarts."""
    if cfg.cycles is None:
        return [0]
    if isinstance(cfg.cycles, int):
        return [k * max_steps // cfg.cycles for k in range(cfg.cycles)]
    return [0, *cfg.cycles]


def cycle_warmup(cfg: SchedulerConfig, cycle: int) -> int:
    rewarmup = cfg.warmup_steps if cfg.rewarmup_steps is None else cfg.rewarmup_steps
    return cfg.warmup_steps if cycle == 0 else rewarmup


def one_cycle(cfg: SchedulerConfig, length: int, warmup: int) -> Callable[[int], float]:
    """The schedule of a run (or cycle) of `length` steps that warms up over `warmup`, by its local step."""
    decay = SCHEDULERS.chosen(cfg).decay  # the schedule's own config (engine/train/schedule_shapes.py)
    hold = stable_steps(cfg)
    decay_steps = cfg.decay_steps or default_decay_steps(cfg, length, warmup)

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if step < warmup + hold:
            return 1.0
        return decay(step - warmup - hold, decay_steps)

    return multiplier


def lr_multiplier(cfg: SchedulerConfig, max_steps: int) -> Callable[[int], float]:
    starts = cycle_starts(cfg, max_steps)
    ends = [*starts[1:], max_steps]
    cycles = [one_cycle(cfg, end - start, cycle_warmup(cfg, k)) for k, (start, end) in enumerate(zip(starts, ends))]
    if len(cycles) == 1:
        return cycles[0]

    def multiplier(step: int) -> float:
        k = bisect_right(starts, step) - 1
        return cycles[k](step - starts[k])

    return multiplier


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    cfg: SchedulerConfig,
    max_steps: int,
    phase_scale: Callable[[int], float] | None = None,
    position: Callable[[int], int] | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """`phase_scale`: the data phases' lr multiplier by step (engine.data.mixture.lr_scale), when they have one.
    `position`: step → where the schedule is read (tokens before it, for scheduler.unit = "tokens"), with
    `max_steps` the run's length in that unit; None = the step itself."""
    import torch  # here, not at the top: validate-config imports this module and must not load torch

    multiplier = lr_multiplier(cfg, max_steps)
    if position is not None:
        multiplier = read_at(multiplier, position)
    for group in optimizer.param_groups:
        # torchao's optimizers keep lr as a tensor, which LambdaLR fills in place; its base lr as a Python
        # float keeps the schedule's state JSON (a checkpoint's train state) and its arithmetic the same on resume.
        group.setdefault("initial_lr", float(group["lr"]))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, with_phase_scale(multiplier, phase_scale))


def read_at(multiplier: Callable[[int], float], position: Callable[[int], int]) -> Callable[[int], float]:
    return lambda step: multiplier(position(step))


def schedule_axis(cfg: JobConfig, world_size: int = 1) -> tuple[Callable[[int], int] | None, int]:
    """(step → position in scheduler.unit, or None for steps; the run's length in that unit) of a config whose
    max_steps is derived (engine/plan/length.py)."""
    if cfg.scheduler.unit == "steps":
        return None, cfg.train.max_steps
    plan = batch_plan(cfg, world_size)
    return plan.tokens_before, plan.tokens_before(cfg.train.max_steps - 1) + 1


def job_scheduler(
    optimizer: torch.optim.Optimizer, cfg: JobConfig, world_size: int = 1
) -> torch.optim.lr_scheduler.LambdaLR:
    """The run's schedule: `cfg.scheduler` in its unit, times the data phases' lr scale."""
    position, length = schedule_axis(cfg, world_size)
    return build_scheduler(optimizer, cfg.scheduler, length, lr_scale(cfg.data), position)


def with_phase_scale(
    multiplier: Callable[[int], float], phase_scale: Callable[[int], float] | None
) -> Callable[[int], float]:
    if phase_scale is None:
        return multiplier  # no phase scales the lr: the schedule is exactly the scheduler's
    return lambda step: multiplier(step) * phase_scale(step)


def schedule_free_warmup(steps: int, step: int) -> float:
    """Schedule-free AdamW's own warmup (its reference implementation's form): (k + 1) / N for k < N."""
    return min((step + 1) / steps, 1.0) if steps else 1.0


def learning_rate(cfg: JobConfig, step: int, world_size: int = 1) -> float:
    """The peak learning rate (`optimizer.lr` times every multiplier) that 0-based `step` trains with."""
    position, length = schedule_axis(cfg, world_size)
    schedule = lr_multiplier(cfg.scheduler, length)
    multiplier = with_phase_scale(schedule if position is None else read_at(schedule, position), lr_scale(cfg.data))
    multiplier = multiplier(step)
    if cfg.optimizer.name == "schedule_free_adamw":
        multiplier *= schedule_free_warmup(cfg.optimizer.schedule_free_warmup_steps, step)
    return cfg.optimizer.lr * multiplier


def key_steps(cfg: JobConfig, world_size: int = 1) -> list[int]:
    """The 0-based steps where the schedule changes phase: first, end of warmup, end of stable, floor, last;
    for every cycle of a warm-restart schedule (its first step, the end of its rewarmup, …). In tokens: the
    steps around each such point, and where the batch ramp rises."""
    position, length = schedule_axis(cfg, world_size)
    marks = schedule_marks(cfg.scheduler, length)
    last = cfg.train.max_steps - 1
    if position is not None:
        plan = batch_plan(cfg, world_size)
        firsts = {plan.steps_for_tokens(mark) for mark in marks}
        marks = {last} | firsts | {step - 1 for step in firsts} | {first for first, _, _ in plan.segments}
    else:
        marks.add(last)
    if cfg.optimizer.name == "schedule_free_adamw":
        marks.add(cfg.optimizer.schedule_free_warmup_steps - 1)
    if cfg.data.datasets:  # where a data phase starts (and may change the lr's scale)
        marks |= {step for p in mixture_phases(cfg.data) if p.start_step for step in (p.start_step - 1, p.start_step)}
    return sorted(m for m in marks if 0 <= m <= last)


def schedule_marks(s: SchedulerConfig, length: int) -> set[int]:
    """Where the schedule of a run of `length` (in its unit) changes phase, in that unit."""
    starts = cycle_starts(s, length)
    marks = {length - 1}
    for k, (start, end) in enumerate(zip(starts, [*starts[1:], length])):
        warmup = cycle_warmup(s, k)
        peak = start + warmup + stable_steps(s)
        marks |= {start, start + warmup - 1, start + warmup, peak, end - 1}
        floor = peak + (s.decay_steps or default_decay_steps(s, end - start, warmup))
        if s.name not in ("constant", "none", "inv_sqrt") and floor < end:
            marks.add(floor)
    return marks


def with_pinned_schedule(cfg: JobConfig, world_size: int = 1) -> JobConfig:
    """The config with `scheduler.decay_steps` resolved, as the run directory records it: a run resumed
    with a larger train.max_steps then continues the schedule it trained with (at the floor once decayed)
    instead of stretching the decay and jumping the LR. With warm restarts a number of cycles is pinned to
    its step boundaries instead, and each cycle keeps its own default decay."""
    if cfg.scheduler.cycles is not None:  # (in steps: validation refuses cycles in tokens)
        starts = cycle_starts(cfg.scheduler, cfg.train.max_steps)[1:]
        return cfg.model_copy(update={"scheduler": cfg.scheduler.model_copy(update={"cycles": starts or 1})})
    if cfg.scheduler.decay_steps is not None or cfg.scheduler.name == "inv_sqrt":  # inv_sqrt has no decay length
        return cfg
    decay = default_decay_steps(cfg.scheduler, schedule_axis(cfg, world_size)[1])
    return cfg.model_copy(update={"scheduler": cfg.scheduler.model_copy(update={"decay_steps": decay})})


def schedule_state(scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict:
    """The scheduler's state as JSON (a checkpoint's train state): the lrs it last set are tensors under
    torchao's optimizers (their param groups' lr is one), reported only, never read back to compute."""
    import torch

    state = scheduler.state_dict()
    return {
        k: [float(x) if isinstance(x, torch.Tensor) else x for x in v] if isinstance(v, list) else v
        for k, v in state.items()
    }
