"""Running a plan: which points are done, which continue, which start; and the plan as one SLURM array job
through `engine.slurm` (each task trains its point's config into its run directory). Torch-free.

A point's run directory is `PLAN_DIR/runs/NAME`. One that holds a complete run is skipped; one that holds an
interrupted run is trained again with the same config, which Forge's own auto-resume continues from its
newest checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from engine.errors import UserError
from engine.run_files import RUN_CONFIG
from engine.runs import summarize_run
from engine.scale.plan import RUNS, Plan, PlanPoint
from engine.slurm.jobs import Submission, prepare
from engine.slurm.render import SlurmRequest, SweepPoint


@dataclass(frozen=True)
class PointState:
    point: PlanPoint
    config: Path
    run_dir: Path
    state: str  # complete | resume | new

    @property
    def pending(self) -> bool:
        return self.state != "complete"


def point_states(plan_dir: Path, plan: Plan) -> list[PointState]:
    """Each point with where its run stands. A config that has gone missing is an error: the point could not
    be trained as planned."""
    states = []
    for point in plan.points:
        config, run_dir = plan_dir / point.config, plan_dir / point.run_dir
        if not config.is_file():
            raise UserError(f"the plan's config {config} is missing", "write the plan again with `forge scale plan`")
        if not (run_dir / RUN_CONFIG).is_file():
            state = "new"
        else:
            summary = summarize_run(run_dir)
            done = summary.status == "complete" and summary.step == point.max_steps
            state = "complete" if done else "resume"
        states.append(PointState(point, config, run_dir, state))
    return states


def check_local(plan: Plan) -> None:
    if plan.world_size != 1:
        raise UserError(
            f"the plan was made for {plan.world_size} processes (its steps count their tokens); "
            "`forge scale run` trains one process at a time",
            "submit it with --slurm for that world size, or plan again with --world-size 1",
        )


def slurm_submission(
    plan_dir: Path, plan: Plan, req: SlurmRequest, template: Path, argv: list[str]
) -> tuple[Submission, list[PointState]]:
    """One array job of the unfinished points, through `forge slurm submit`'s checks and template. The
    request's run directory is the plan's runs folder (it keeps the job's script and records)."""
    if req.world_size != plan.world_size:
        raise UserError(
            f"the job has {req.world_size} processes (--nodes × tasks per node), but the plan was made for "
            f"{plan.world_size}: each point's steps are counted for that many",
            f"ask for {plan.world_size} processes, or plan again with --world-size {req.world_size}",
        )
    todo = [s for s in point_states(plan_dir, plan) if s.pending]
    if not todo:
        raise UserError(f"every point of {plan_dir} has finished", "fit them: forge scale fit " + str(plan_dir))
    req = replace(req, preset=todo[0].config, run_dir=(plan_dir / RUNS).resolve(), overrides=[], sweep=[])
    points = [SweepPoint([], s.run_dir.resolve(), s.config.resolve()) for s in todo]
    return prepare(req, template, argv, points), todo
