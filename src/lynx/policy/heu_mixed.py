"""Beyond the paper: mixed policies per stage. HEU applies one layer policy to all N layers of a stage, so
the memory it can use is quantized by N; two policies (k layers each) use what one leaves over."""

from __future__ import annotations

from lynx.decisions import RecomputePolicy, SolveStats, StageContext
from lynx.errors import InfeasibleError
from lynx.graph import LayerGraph
from lynx.policy.heu import HeuOptions, critical_recompute, solve_stage


def mixed_policy(ctx: StageContext, graph: LayerGraph, opts: HeuOptions | None = None) -> RecomputePolicy:
    """Beyond the paper: two layer policies per stage, k layers with one (bottom) and the rest with the
    other (top), which uses the memory a single policy leaves over (HEU's memory use is quantized by
    N_layer). Both policies are searched jointly (one ILP with two copies of the layer variables and the
    exact memory rows of the two runs) for every k; k = 0 is plain HEU. (Fixing the top run to the HEU
    policy and searching only the other was measured weaker and no faster: docs/heu.md.)"""
    opts = opts or HeuOptions()
    best = solve_stage(ctx, graph, opts)
    total_time, tried = best.stats.solve_time_s, 0
    if critical_recompute(graph, best.layers, ctx, opts.cooldown_overlap) <= 0.0:
        return best  # nothing on the critical path: a split could only trim the tie-break
    for k in range(1, ctx.num_layers):
        try:
            cand = solve_stage(ctx, graph, opts, (k, ctx.num_layers - k), explain=False)
        except InfeasibleError:
            continue
        tried += 1
        total_time += cand.stats.solve_time_s
        if cand.stats.objective < best.stats.objective * (1 - 1e-6) - 1e-12:
            best = cand
    stats = SolveStats(best.stats.solver, best.stats.status, best.stats.objective, total_time,
                       best.stats.num_variables, best.stats.num_constraints, best.stats.mip_gap,
                       best.stats.message + f"; {tried} splits tried")
    return RecomputePolicy(best.method, best.layers, best.cooldown_overlap, stats)
