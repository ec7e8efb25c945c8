"""Lynx-OPT and Checkmate as planning methods: the MILP per stage on the dp (or the user's) partition, then
the simulator as the judge."""

from __future__ import annotations

from lynx.errors import SpecError
from lynx.graph import LayerGraph
from lynx.methods.common import per_stage
from lynx.policy.base import RecomputePolicy, StageContext
from lynx.policy.opt import OptOptions, checkmate_options, solve_stage, stderr_progress
from lynx.problem import PlanProblem, PlanResult
from lynx.simulate import simulate


def _plan(problem: PlanProblem, opts: OptOptions) -> PlanResult:
    if problem.options.vpp > 1:
        raise SpecError(f"{opts.method} plans 1F1B stages only (--vpp 1); its timeline has one chunk per stage")

    def fn(ctx: StageContext, graph: LayerGraph) -> RecomputePolicy:
        o = OptOptions(overlap=opts.overlap, time_limit_s=problem.options.time_limit_s, backend=opts.backend,
                       method=opts.method,
                       cooldown_overlap=opts.cooldown_overlap and problem.options.cooldown_overlap,
                       progress=opts.progress or stderr_progress(f"{opts.method} stage {ctx.stage} (ms)"))
        return solve_stage(ctx, graph, o).policy

    res = per_stage(problem, opts.method, fn)
    sim = simulate(problem, res.partition, res.policies, record=False)
    if sim.oom:  # the closed form is an upper bound of the simulator's memory: this is a bug
        raise AssertionError(f"{opts.method}: the simulator finds the plan out of memory")
    notes = tuple(f"stage {s}: {p.stats.status}, {p.stats.message}" for s, p in enumerate(res.policies))
    return PlanResult(res.method, res.partition, res.policies, notes, res.search_time_s)


def plan_lynx_opt(problem: PlanProblem) -> PlanResult:
    return _plan(problem, OptOptions())


def plan_checkmate(problem: PlanProblem) -> PlanResult:
    return _plan(problem, checkmate_options())
