"""Lynx-OPT (paper sec. 4.1) and Checkmate (Jain et al., MLSys'20): one phase-indexed MILP, two flags.

``lynx-opt`` lets recomputation hide in the forward collectives of the next forward pass (phases 1, 2) and in
the backward collectives of the layer above (phases 3, 4); ``checkmate`` is the same program without
windows, so every recomputation is on the critical path (phase 5). Both return the common
`RecomputePolicy`; the schedule is replayed by `lynx.policy.opt_check` before it is used, and the methods
(`lynx.methods.opt`) simulate the plan once more before they return it.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from lynx.cost.memory import stage_peak_bytes
from lynx.decisions import (
    LayerPolicy,
    Phase,
    RecomputePolicy,
    SolveStats,
    StageContext,
    validate_layer_policy,
)
from lynx.errors import InfeasibleError, LynxError
from lynx.graph import LayerGraph
from lynx.milp import Backend, MilpSolution
from lynx.policy.opt_check import Schedule, check_schedule, policy_to_schedule
from lynx.policy.opt_model import OptModel, build
from lynx.policy.opt_timeline import Timeline, build_timeline
from lynx.policy.rules import full_policy, none_policy

GiB = float(1 << 30)
Progress = Callable[[str], None]


class SolverTimeoutError(LynxError):
    """The MILP found no schedule at all within its time limit."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OptOptions:
    overlap: bool = True
    """True: Lynx-OPT (windows hide recomputation). False: Checkmate (no overlap)."""
    time_limit_s: float = 30.0
    backend: Backend = "auto"
    method: str = "lynx-opt"
    cooldown_overlap: bool = True
    progress: Progress | None = None
    start: tuple[LayerPolicy, ...] | None = None
    """A policy to start the search from (e.g. Lynx-HEU's); used when it fits, else none / full."""


@dataclass(frozen=True, slots=True)
class OptResult:
    policy: RecomputePolicy
    schedule: Schedule
    solution: MilpSolution
    counts: dict[str, int]
    critical_s: float
    """The objective (Eq. 1 minus the fixed forward and backward): critical-path recomputation per
    micro-batch, in seconds."""


def checkmate_options(time_limit_s: float = 30.0, progress: Progress | None = None) -> OptOptions:
    return OptOptions(overlap=False, time_limit_s=time_limit_s, method="checkmate", cooldown_overlap=False,
                      progress=progress)


def extract_schedule(om: OptModel, sol: MilpSolution) -> Schedule:
    R = frozenset(k for k, h in om.R.items() if sol.is_one(h))
    S = frozenset(k for k, h in om.S.items() if sol.is_one(h))
    return Schedule(om.tl, R, S)


def _phase(tl: Timeline, t: int, v: int) -> Phase:
    st = tl.stages[t]
    if tl.overlap and st.window is not None and tl.layer_of(v) == st.serves:
        return st.window
    return Phase.ON_DEMAND


def schedule_to_policy(sched: Schedule) -> tuple[LayerPolicy, ...]:
    """Per layer: kept = retained across the forward -> backward boundary; recomputed in the phase of the
    stage that runs it (a window serving the layer: 1-4; the layer's own backward: 5). Retained or
    recomputed outputs that no backward and no recomputation reads are dropped (they only cost memory)."""
    tl, g = sched.timeline, sched.timeline.graph
    names, needed = g.names, g.needed()
    out: list[LayerPolicy] = []
    for ly in range(tl.num_layers):
        keep = {names[tl.op_of(v)] for (t, v) in sched.S if t == tl.first_post and tl.layer_of(v) == ly}
        rec = {names[tl.op_of(v)]: _phase(tl, t, v) for (t, v) in sched.R if tl.layer_of(v) == ly}
        while True:
            reads = needed | {d for n in rec for d in g.op(n).inputs}
            useless = [n for n in (*keep, *rec) if n not in reads]
            if not useless:
                break
            for n in useless:
                keep.discard(n)
                rec.pop(n, None)
        out.append(LayerPolicy(frozenset(keep), tuple((n, rec[n]) for n in names if n in rec)))
    return tuple(out)


def reported_gap(sol: MilpSolution) -> float:
    """The MIP gap; at a time limit before HiGHS has any dual bound, 100% (0 is always a bound: every
    term of the objective is a non-negative recomputation time)."""
    if sol.status == "time_limit" and sol.objective > 1e-12 and not (0 < sol.mip_gap < math.inf):
        return 1.0
    return sol.mip_gap


def _stats(sol: MilpSolution, counts: dict[str, int], msg: str) -> SolveStats:
    sizes = ", ".join(f"{k} {v}" for k, v in counts.items() if k in "RSUF")
    return SolveStats(solver=sol.backend, status=sol.status, objective=sol.objective / 1e3,
                      solve_time_s=sol.solve_time_s, num_variables=sol.num_variables,
                      num_constraints=sol.num_constraints, mip_gap=reported_gap(sol),
                      message=f"{msg}; variables {sizes}")


def _no_solution(sol: MilpSolution, ctx: StageContext, graph: LayerGraph, opts: OptOptions) -> LynxError:
    if sol.status == "infeasible":
        full = stage_peak_bytes(graph, full_policy(ctx, graph).layers, ctx)
        return InfeasibleError(
            f"{opts.method}: no schedule fits stage {ctx.stage} ({ctx.num_layers} layers) in "
            f"{ctx.budget_bytes / GiB:.2f} GiB; full recomputation needs {full / GiB:.2f} GiB", (full,))
    return SolverTimeoutError(
        f"{opts.method}: no schedule found for stage {ctx.stage} ({ctx.num_layers} layers) within "
        f"{opts.time_limit_s:g} s (HiGHS status {sol.status}); raise --time-limit")


def warm_start(om: OptModel, ctx: StageContext, graph: LayerGraph,
               given: tuple[LayerPolicy, ...] | None = None) -> dict[int, float] | None:
    """R, S and F of a known feasible schedule (`given` if it fits, else no recomputation if it fits,
    else Megatron full, laid on the timeline), so that HiGHS holds an incumbent from the start and a
    time-out always returns one."""
    tl = om.tl
    for layers in (given, none_policy(ctx, graph).layers, full_policy(ctx, graph).layers):
        if layers is None or stage_peak_bytes(graph, layers, ctx) > ctx.budget_bytes:
            continue
        sched = policy_to_schedule(tl, layers)
        if not check_schedule(sched, ctx).ok:
            continue
        start = {h: float(k in sched.R) for k, h in om.R.items()}
        start.update({h: float(k in sched.S) for k, h in om.S.items()})
        for (t, d, pos), h in om.F.items():
            cands = tl.candidates(t)
            later = any((t, c.node) in sched.R and d in tl.inputs(c.node) for c in cands[pos + 1:])
            start[h] = float((t, cands[pos].node) in sched.R and (t + 1, d) not in sched.S and not later)
        return start
    return None


def _keep_everything(tl: Timeline, ctx: StageContext, graph: LayerGraph, opts: OptOptions) -> OptResult | None:
    """When keeping every activation fits (both bounds), it is optimal: the objective is a sum of
    non-negative recomputation times and this schedule has none. No MILP is built."""
    t0 = time.perf_counter()
    layers = none_policy(ctx, graph).layers
    if stage_peak_bytes(graph, layers, ctx) > ctx.budget_bytes:
        return None
    sched = policy_to_schedule(tl, layers)
    if not check_schedule(sched, ctx).ok:
        return None
    dt = time.perf_counter() - t0
    sol = MilpSolution("optimal", 0.0, (), dt, 0.0, 0, 0, "none")
    stats = SolveStats(solver="none", status="optimal", solve_time_s=dt,
                       message="keeping every activation fits: no recomputation, no MILP needed")
    pol = RecomputePolicy(opts.method, layers, cooldown_overlap=opts.cooldown_overlap, stats=stats)
    return OptResult(pol, sched, sol, {}, 0.0)


def solve_stage(ctx: StageContext, graph: LayerGraph, opts: OptOptions = OptOptions()) -> OptResult:
    """Build, solve, check and map the program for one stage."""
    tl = build_timeline(graph, ctx.num_layers, ctx.has_fwd_windows, opts.overlap, ctx.subtract_wgrad)
    trivial = _keep_everything(tl, ctx, graph, opts)
    if trivial is not None:
        return trivial
    om = build(tl, ctx)
    sol = om.milp.solve(opts.time_limit_s, backend=opts.backend, progress=opts.progress,
                        start=warm_start(om, ctx, graph, opts.start))
    if not sol.has_solution:
        raise _no_solution(sol, ctx, graph, opts)
    sched = extract_schedule(om, sol)
    chk = check_schedule(sched, ctx)
    layers = schedule_to_policy(sched)
    errs = list(chk.errors)
    for i, lp in enumerate(layers):
        errs += [f"layer {i}: {e}" for e in validate_layer_policy(graph, lp, ctx.has_fwd_windows)]
    peak = stage_peak_bytes(graph, layers, ctx)
    if peak > ctx.budget_bytes * (1 + 1e-6):
        errs.append(f"layer-level peak {peak / GiB:.3f} GiB over the budget")
    if errs:  # a modelling bug, never a user error
        raise AssertionError(f"{opts.method} produced an invalid schedule: " + "; ".join(errs[:5]))
    crit = sol.objective / 1e3
    gap = f", gap {reported_gap(sol):.2%}" if sol.status != "optimal" else ""
    msg = f"critical recompute {crit * 1e3:.3f} ms per micro-batch{gap}"
    pol = RecomputePolicy(opts.method, layers, cooldown_overlap=opts.cooldown_overlap,
                          stats=_stats(sol, om.counts, msg))
    return OptResult(pol, sched, sol, om.counts, crit)


def opt_policy(ctx: StageContext, graph: LayerGraph, opts: OptOptions = OptOptions()) -> RecomputePolicy:
    """Lynx-OPT for one stage (the common per-stage signature)."""
    return solve_stage(ctx, graph, opts).policy


def checkmate_policy(ctx: StageContext, graph: LayerGraph, opts: OptOptions | None = None) -> RecomputePolicy:
    """Checkmate for one stage: the same program without overlap."""
    return solve_stage(ctx, graph, opts or checkmate_options()).policy


def stderr_progress(prefix: str) -> Progress:
    def show(line: str) -> None:
        print(f"{prefix}: {line}", file=sys.stderr, flush=True)

    return show


__all__ = ["OptOptions", "OptResult", "SolverTimeoutError", "checkmate_options",
           "checkmate_policy", "opt_policy", "schedule_to_policy", "solve_stage"]
