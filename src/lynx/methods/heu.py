"""The planning methods built on Lynx-HEU: `lynx` (HEU + recomputation-aware partitioning, the default),
`lynx-heu` (HEU on dp partitioning: the breakdown's "HEU alone") and `lynx-mixed` (lynx plus two layer
policies per stage where that uses the budget better)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from lynx.decisions import RecomputePolicy, StageContext
from lynx.errors import InfeasibleError, SpecError
from lynx.graph import Graphs, LayerGraph
from lynx.methods.common import (
    base_partition,
    edge_times_per_stage,
    iteration_time,
    megatron_partition,
    one_kind_only,
    plain_time,
)
from lynx.partition.base import Partition
from lynx.partition.lynx import PartitionSearch, search_partitions
from lynx.partition.stack import stack_partition
from lynx.policy.heu import OFFLOAD_HIGHS_OPTIONS, OFFLOAD_MIP_GAP, HeuCache, HeuOptions, infeasible
from lynx.policy.heu_mixed import mixed_policy
from lynx.policy.offload import offload_link
from lynx.problem import PlanProblem, PlanResult


def heu_options(problem: PlanProblem, method: str) -> HeuOptions:
    # offloading as HEU's third choice only for the offload method (lynx.methods.offload; docs/offload.md)
    link = offload_link(problem.hardware) if method == "lynx-offload" else None
    return HeuOptions(cooldown_overlap=problem.options.cooldown_overlap,
                      time_limit_s=min(problem.options.time_limit_s, 10.0), method=method, offload=link,
                      mip_gap=1e-6 if link is None else OFFLOAD_MIP_GAP,
                      highs_options=() if link is None else OFFLOAD_HIGHS_OPTIONS)


def stage_time(graph: Graphs, ctx: StageContext, pol: RecomputePolicy) -> float:
    """Seconds per micro-batch on the stage (the paper's Training Cost Model): layers' F + B plus the HEU
    objective (critical recomputation, with its tiny tie-break, which keeps the cost monotone in N)."""
    if isinstance(graph, LayerGraph):
        return ctx.num_layers * graph.step_time(ctx.subtract_wgrad) + pol.stats.objective
    return sum(g.step_time(ctx.subtract_wgrad) for g in graph) + pol.stats.objective


def policies_for(problem: PlanProblem, part: Partition, cache: HeuCache,
                 explain: bool = True) -> tuple[RecomputePolicy, ...]:
    """HEU on every stage of `part`; one InfeasibleError naming every stage's smallest budget if any fails."""
    ctxs = problem.stage_contexts(part)
    res = cache.get_all(ctxs)
    if any(isinstance(r, InfeasibleError) for r in res):
        if not explain:
            raise InfeasibleError("no policy fits")
        raise infeasible(problem.graphs_for, list(ctxs), cache.opts)
    return tuple(r for r in res if isinstance(r, RecomputePolicy))


REFINE_MAX_ACTIONS = 512
"""Refine by simulation only where one simulation is cheap (pp x micro-batches forwards, ~10 ms)."""


def _refine(problem: PlanProblem, part: Partition, best_t: float, cache: HeuCache,
            max_sims: int = 40) -> tuple[float, Partition, tuple[RecomputePolicy, ...]] | None:
    """Beyond min-max: the stage-time proxy ignores pipeline fill and drain, which matter when micro-
    batches are few. Local search with the event simulator as the judge: move one layer between any two
    stages (virtual stages when interleaved), take the first improvement, repeat (at most `max_sims`
    simulations). A move whose partition, keeping every activation, is already no faster than the best
    (`plain_time`, one simulation) cannot improve whatever its policies: it is judged on that, without solving its
    stages' problems (counted as a simulation, so the moves tried are those the full judgement would try, unless
    some of them fit no policy)."""
    counts = list(part.virtual_layers())
    pp = problem.parallel.pp
    found: tuple[float, Partition, tuple[RecomputePolicy, ...]] | None = None
    sims, improved = 0, True
    while improved and sims < max_sims:
        improved = False
        for a in range(len(counts)):
            for b in range(len(counts)):
                if a == b or counts[a] <= 1 or sims >= max_sims:
                    continue
                cand = list(counts)
                cand[a] -= 1
                cand[b] += 1
                new = Partition.interleaved(tuple(cand), pp, method="lynx-refined")
                if PLAIN_SAFETY * plain_time(problem, new) >= best_t * (1 - 1e-9):
                    sims += 1
                    continue
                try:
                    pols = policies_for(problem, new, cache, explain=False)
                except InfeasibleError:
                    continue
                sims += 1
                t = _iteration(problem, new, pols)
                if t < best_t * (1 - 1e-9):
                    best_t, counts, found, improved = t, cand, (t, new, pols), True
                    break
            if improved:
                break
    return found


_iteration = iteration_time
PLAIN_SAFETY = 1.0 - 1e-9
"""`plain_time` is summed in another order than a policy's simulation: it may round differently."""


def lynx_heu(problem: PlanProblem) -> PlanResult:
    t0 = time.perf_counter()
    cache = HeuCache(problem.graph, heu_options(problem, "lynx-heu"), kind_graphs=problem.kind_graphs)
    part = base_partition(problem)
    pols = policies_for(problem, part, cache)
    note = f"HEU: {cache.solves} stage problems, {cache.solve_time_s * 1e3:.1f} ms solving"
    return PlanResult("lynx-heu", part, pols, (note,), time.perf_counter() - t0)


def _even_candidate(problem: PlanProblem, dp: Partition, cache: HeuCache
                    ) -> tuple[Partition, tuple[RecomputePolicy, ...]] | None:
    """Megatron-Core's own split (`megatron_partition`) with HEU's policies, when it differs from `dp` and
    fits. The dp split balances parameters, which can lengthen the pipeline (an interleaved chunk with one
    layer more than the others); the simulator judges both, so lynx's plan is never slower than HEU on the
    split stock Megatron runs."""
    try:
        even = megatron_partition(problem)
    except SpecError:
        return None  # Megatron refuses the layout (the layers do not divide): no even split to try
    if even.layers_per_stage == dp.layers_per_stage and even.chunks == dp.chunks:
        return None
    try:
        return even, policies_for(problem, even, cache, explain=False)
    except InfeasibleError:
        return None


def _interleaved_search(problem: PlanProblem, method: str, cache: HeuCache, t0: float,
                        refine_ok: bool = True, explain: bool = True) -> PlanResult:
    """Interleaved chunks: HEU on the dp split of the virtual stages, then (where one simulation is cheap)
    the simulator-judged local search moving one layer between virtual stages. The greedy / exact min-max
    searches over per-rank layer counts do not apply to chunks."""
    par = problem.parallel
    dp = base_partition(problem)
    even = _even_candidate(problem, dp, cache) if refine_ok else None
    try:
        pols = policies_for(problem, dp, cache, explain and even is None)
    except InfeasibleError:
        if even is None:
            raise
        pols = ()
    best_t, part, label = math.inf, dp, "dp"
    if pols:
        best_t = _iteration(problem, dp, pols) if refine_ok else math.inf
    if even is not None:
        t_even = _iteration(problem, even[0], even[1])
        if t_even < best_t:
            best_t, (part, pols), label = t_even, even, "even"
    if refine_ok and par.pp * par.num_microbatches * problem.options.vpp <= REFINE_MAX_ACTIONS:
        refined = _refine(problem, part, best_t, cache)
        if refined is not None:
            best_t, part, pols = refined
            label = "refined"
    notes = (f"interleaved: dp split of the {len(dp.chunks)} virtual stages {dp}"
             + (f", Megatron's even split {part} is faster ({best_t:.3f} s)" if label == "even" else "")
             + (f", refined by simulation to {part} ({best_t:.3f} s)" if label == "refined" else ""),
             f"HEU: {cache.solves} distinct stage problems ({cache.hits} cache hits), "
             f"{cache.solve_time_s * 1e3:.1f} ms solving")
    chosen = Partition(part.layers_per_stage, f"lynx-{label}" if label != "dp" else "dp", part.chunks)
    return PlanResult(method, chosen, pols, notes, time.perf_counter() - t0)


def lynx_search(problem: PlanProblem, method: str, cache: HeuCache | None = None,
                refine_ok: bool = True, explain: bool = True) -> tuple[PlanResult, HeuCache]:
    """HEU + recomputation-aware partitioning: dp, the paper's greedy loop and the exact min-max search
    each give a partition; the event simulator measures all three and the fastest that fits wins (so the
    result is never slower than dp partitioning with HEU). `cache`: stage solutions shared with other
    problems on the same graph and HEU options (the configuration search, `lynx.search`); `refine_ok=False`
skips the simulator-judged local search (the configuration search screens without it, then refines its
finalists); `explain=False`: when nothing fits, say so without solving for each stage's smallest budget."""
    t0 = time.perf_counter()
    if cache is None or cache.graph is not problem.graph or cache.opts != heu_options(problem, method) \
            or cache.kind_graphs != problem.kind_graphs:
        cache = HeuCache(problem.graph, heu_options(problem, method), kind_graphs=problem.kind_graphs)
    if problem.options.layers_per_stage is not None:  # the user's partition is not second-guessed
        part = base_partition(problem)
        return PlanResult(method, part, policies_for(problem, part, cache), ("explicit partition",),
                          time.perf_counter() - t0), cache
    if problem.options.vpp > 1:
        return _interleaved_search(problem, method, cache, t0, refine_ok, explain), cache

    par = problem.parallel
    # The first and last stages also run the embedding and the LM head + loss (as the simulator charges).
    edge = edge_times_per_stage(problem)

    search = _partition_search(problem, cache, edge)
    dp = base_partition(problem)
    cands: dict[tuple[int, ...], tuple[str, Partition]] = {}
    for label, cand in (("dp", dp), ("greedy", search.greedy), ("exact", search.exact)):
        if cand is not None and cand.layers_per_stage not in cands:
            cands[cand.layers_per_stage] = (label, cand)
    if refine_ok:  # Megatron's own split as a candidate too (`_even_candidate`); the search's screen skips it
        even = _even_candidate(problem, dp, cache)
        if even is not None and even[0].layers_per_stage not in cands:
            cands[even[0].layers_per_stage] = ("even", even[0])
    measured: list[tuple[float, str, Partition, tuple[RecomputePolicy, ...]]] = []
    refine = refine_ok and par.pp * par.num_microbatches <= REFINE_MAX_ACTIONS
    for label, part in cands.values():
        try:
            pols = policies_for(problem, part, cache, explain=False)
        except InfeasibleError:
            continue
        # One candidate needs no measurement (unless refined); several are measured by the simulator.
        t = _iteration(problem, part, pols) if len(cands) > 1 or refine else 0.0
        measured.append((t, label, part, pols))
    if not measured:
        policies_for(problem, dp, cache, explain)  # raises with the per-stage smallest budgets on dp
        raise InfeasibleError("no partition fits")  # pragma: no cover (policies_for raised)
    measured.sort(key=lambda x: x[0])
    best_t, label, part, pols = measured[0]
    if refine:
        refined = _refine(problem, part, best_t, cache)
        if refined is not None:
            best_t, part, pols = refined
            label = "refined"
            measured.append((best_t, label, part, pols))
    notes = (
        f"partition: greedy {search.greedy or '-'} (max stage {search.greedy_cost * 1e3:.2f} ms/mb), "
        f"exact {search.exact or '-'} (max stage {search.exact_cost * 1e3:.2f} ms/mb), dp {dp}; "
        + (", ".join(f"{lb} {p} -> {t:.3f} s" for t, lb, p, _ in measured) if len(measured) > 1
           else "all the same") + f"; chose {label}",
        f"HEU: {cache.solves} distinct stage problems ({cache.hits} cache hits), "
        f"{cache.solve_time_s * 1e3:.1f} ms solving, {search.evaluations} stage costs evaluated",
    )
    chosen = Partition(part.layers_per_stage, method=f"lynx-{label}" if label != "dp" else "dp")
    return PlanResult(method, chosen, pols, notes, time.perf_counter() - t0), cache


def _partition_search(problem: PlanProblem, cache: HeuCache, edge: list[float]) -> PartitionSearch:
    """The greedy and exact searches over layer counts (one layer kind), or the min-max over contiguous splits of a
    stack of several kinds (`partition.stack`), on HEU's stage costs plus the first / last stage's edges."""
    par = problem.parallel
    if problem.heterogeneous:
        def cost3(stage: int, first: int, n: int) -> float:
            ctx = problem.stage_context(stage, n, kinds=problem.range_kinds(first, n))
            r = cache.get(ctx)
            return math.inf if isinstance(r, InfeasibleError) else \
                stage_time(problem.graphs_for(ctx), ctx, r) + edge[stage]

        prefix = [0.0]
        for kind in problem.range_kinds(0, problem.model.num_layers):
            prefix.append(prefix[-1] + problem.kind_graph(kind).step_time(problem.options.subtract_wgrad))

        def lower3(stage: int, first: int, n: int) -> float:
            # cost3 is the layers' step times plus the HEU objective (>= 0) plus the edge (as `lower` below)
            return (prefix[first + n] - prefix[first] + edge[stage]) * (1 - 1e-9)

        return stack_partition(problem.model.num_layers, par.pp, cost3, lower=lower3)

    def cost(stage: int, n: int) -> float:
        ctx = problem.stage_context(stage, n)
        return priced(ctx, cache.get(ctx), stage)

    def priced(ctx: StageContext, r: RecomputePolicy | InfeasibleError, stage: int) -> float:
        return math.inf if isinstance(r, InfeasibleError) else stage_time(problem.graph, ctx, r) + edge[stage]

    def many(keys: Sequence[tuple[int, int]]) -> list[float]:
        ctxs = [problem.stage_context(stage, n) for stage, n in keys]
        return [priced(c, r, stage) for c, r, (stage, _) in zip(ctxs, cache.get_all(ctxs), keys, strict=True)]

    u = problem.graph.step_time(problem.options.subtract_wgrad)

    def lower(stage: int, n: int) -> float:
        # cost() is (n * u + objective) + edge with objective >= 0 (a sum of non-negative recomputation times;
        # the margin covers a solver's rounding of it around 0)
        return (n * u + edge[stage]) * (1 - 1e-9)

    return search_partitions(problem.model.num_layers, par.pp, cost, lower=lower, many=many)


def lynx(problem: PlanProblem) -> PlanResult:
    return lynx_search(problem, "lynx")[0]


def lynx_mixed(problem: PlanProblem) -> PlanResult:
    """Mixed policies refine the slowest stage first, then whichever stage is now the slowest, until the
    slowest has been refined (other stages hardly move the iteration time). The simulator judges."""
    one_kind_only(problem, "lynx-mixed")
    t0 = time.perf_counter()
    base, cache = lynx_search(problem, "lynx-mixed")
    if problem.options.vpp > 1:
        note = "mixed policies: not searched for interleaved chunks (the lynx plan)"
        return PlanResult("lynx-mixed", base.partition, base.policies, (*base.notes, note),
                          time.perf_counter() - t0)
    g = problem.graph
    ctxs = problem.stage_contexts(base.partition)
    pols = list(base.policies)
    times = [stage_time(g, c, pol) for c, pol in zip(ctxs, pols, strict=True)]
    done: set[int] = set()
    while True:
        s = max(range(len(pols)), key=lambda i: times[i])
        if s in done:
            break
        done.add(s)
        pols[s] = mixed_policy(ctxs[s], g, cache.opts)
        times[s] = stage_time(g, ctxs[s], pols[s])
    changed = sorted(s for s in done if pols[s].layers != base.policies[s].layers)
    if not changed:
        note = f"mixed policies: no better split on stage(s) {sorted(done)}"
        return PlanResult("lynx-mixed", base.partition, base.policies, (*base.notes, note),
                          time.perf_counter() - t0)
    t_base = _iteration(problem, base.partition, base.policies)
    t_mixed = _iteration(problem, base.partition, tuple(pols))
    if t_mixed < t_base:
        note = f"mixed policies on stage(s) {changed}: {t_base:.4f} s -> {t_mixed:.4f} s"
        out = tuple(pols)
    else:
        out, note = base.policies, f"mixed policies did not help ({t_mixed:.4f} s vs {t_base:.4f} s)"
    return PlanResult("lynx-mixed", base.partition, out, (*base.notes, note), time.perf_counter() - t0)
