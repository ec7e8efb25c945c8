"""Lynx-OPT and Checkmate as planning methods: the MILP per stage on the dp (or the user's) partition, then
the simulator as the judge."""

from __future__ import annotations

from lynx.decisions import LayerPolicy, RecomputePolicy, StageContext
from lynx.errors import InfeasibleError, SpecError
from lynx.graph import LayerGraph
from lynx.methods.common import one_kind_only, per_stage
from lynx.methods.heu import heu_options
from lynx.policy.heu import HeuCache
from lynx.policy.opt import OptOptions, checkmate_options, solve_stage, stderr_progress
from lynx.problem import PlanProblem, PlanResult
from lynx.simulate import simulate


def _plan(problem: PlanProblem, opts: OptOptions) -> PlanResult:
    if problem.options.vpp > 1:
        raise SpecError(f"{opts.method} plans 1F1B stages only (--vpp 1); its timeline has one chunk per stage")

    heu = HeuCache(problem.graph, heu_options(problem, "lynx-heu"))

    def heu_start(ctx: StageContext) -> tuple[LayerPolicy, ...] | None:
        """Lynx-HEU's policy for the stage, the MILP's first incumbent: an exact method stopped by its time
        limit never returns worse than the heuristic (Checkmate has no windows, so HEU's policy is no
        schedule of its program; it starts from no recomputation or full, as before)."""
        if not opts.overlap:
            return None
        r = heu.get(ctx)
        return None if isinstance(r, InfeasibleError) else r.layers

    def fn(ctx: StageContext, graph: LayerGraph) -> RecomputePolicy:
        o = OptOptions(overlap=opts.overlap, time_limit_s=problem.options.time_limit_s, backend=opts.backend,
                       method=opts.method,
                       cooldown_overlap=opts.cooldown_overlap and problem.options.cooldown_overlap,
                       progress=opts.progress or stderr_progress(f"{opts.method} stage {ctx.stage} (ms)"),
                       start=heu_start(ctx))
        return solve_stage(ctx, graph, o).policy

    res = per_stage(problem, opts.method, fn)
    sim = simulate(problem, res.partition, res.policies, record=False)
    if sim.oom:  # the closed form is an upper bound of the simulator's memory: this is a bug
        raise AssertionError(f"{opts.method}: the simulator finds the plan out of memory")
    notes = tuple(f"stage {s}: {p.stats.status}, {p.stats.message}" for s, p in enumerate(res.policies))
    return PlanResult(res.method, res.partition, res.policies, notes, res.search_time_s)


def plan_lynx_opt(problem: PlanProblem) -> PlanResult:
    one_kind_only(problem, "lynx-opt")
    return _plan(problem, OptOptions())


def plan_checkmate(problem: PlanProblem) -> PlanResult:
    one_kind_only(problem, "checkmate")
    return _plan(problem, checkmate_options())
