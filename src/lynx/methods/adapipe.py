"""AdaPipe as a planning method: the per-stage DP (`lynx.policy.adapipe`) and the partitioning DP
(`lynx.partition.adapipe`), candidates compared by the simulator."""

from __future__ import annotations

import math
import time

from lynx.decisions import RecomputePolicy
from lynx.errors import InfeasibleError
from lynx.methods.common import base_partition, edge_times_per_stage, one_kind_only
from lynx.partition.adapipe import adapipe_partition
from lynx.partition.base import Partition
from lynx.policy.adapipe import StageDP, adapipe_stage_policy
from lynx.problem import PlanProblem, PlanResult
from lynx.simulate import simulate

GiB = float(1 << 30)


def _policies(problem: PlanProblem, part: Partition, dp: StageDP) -> tuple[RecomputePolicy, ...] | None:
    try:
        return tuple(adapipe_stage_policy(c, dp) for c in problem.stage_contexts(part))
    except InfeasibleError:
        return None


def plan_adapipe(problem: PlanProblem) -> PlanResult:
    """Interleaved (vpp > 1): the stage DP on the dp partition of the chunks, with each stage's largest
    chunk in-flight count for all its layers (an upper bound); the partitioning DP models 1F1B only."""
    one_kind_only(problem, "adapipe")
    t0 = time.perf_counter()
    par, g = problem.parallel, problem.graph
    L, p, m = problem.model.num_layers, par.pp, par.num_microbatches
    base = base_partition(problem)
    # Stages with more than about twice the average layer count never minimize 1F1B time (the slowest stage
    # would be twice the even split's); leaving them out keeps the DP tables small for 96-layer models.
    cap = max(max(base.layers_per_stage), min(L - p + 1, 2 * math.ceil(L / p) + 2))
    # 8 MiB granules, coarser on big devices so a table row stays <= 4096 granules (sizes still round up).
    granule = max(float(8 << 20), problem.budget_bytes / 4096)
    dp = StageDP(g, cap, problem.budget_bytes, granule)
    lt = g.step_time(problem.options.subtract_wgrad)
    edge = edge_times_per_stage(problem)

    def stage_time(s: int, n: int) -> float:
        if n > dp.max_layers:
            return math.inf
        res = dp.solve(problem.stage_context(s, n))
        return math.inf if res is None else edge[s] + n * lt + res[0]

    cands: list[Partition] = []
    if problem.options.layers_per_stage is None and problem.options.vpp == 1:
        found = adapipe_partition(L, p, m, stage_time)
        if found is not None:
            cands.append(found)
    cands.append(base)
    best: tuple[float, Partition, tuple[RecomputePolicy, ...]] | None = None
    for part in cands:
        pols = _policies(problem, part, dp)
        if pols is None:
            continue
        # The DP's pipeline formula approximates 1F1B; the candidates are compared by the simulator.
        it = simulate(problem, part, pols, record=False).iteration_time_s
        if best is None or it < best[0]:
            best = (it, part, pols)
    if best is None:
        mins = tuple(dp.min_budget(c) for c in problem.stage_contexts(base))
        parts = ", ".join(f"stage {s} needs {b / GiB:.2f} GiB" for s, b in enumerate(mins))
        raise InfeasibleError(f"adapipe: no recomputation fits {problem.budget_bytes / GiB:.2f} GiB on any "
                              f"partition; on {base}: {parts}", mins)
    _, part, pols = best
    note = f"partition {part} ({part.method}); {len(dp.strategies)} strategies per layer"
    return PlanResult("adapipe", part, pols, (note,), time.perf_counter() - t0)
