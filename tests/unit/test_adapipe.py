"""AdaPipe: the unit strategies, the per-stage knapsack DP against brute force, the partitioning DP
against enumeration, on-demand-only policies, and the infeasibility report."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from lynx.api import make_problem, plan
from lynx.cost.memory import stage_peak_bytes
from lynx.decisions import Phase, validate_layer_policy
from lynx.errors import InfeasibleError
from lynx.models import load_model
from lynx.partition.adapipe import adapipe_partition, pipeline_time
from lynx.policy.adapipe import StageDP, adapipe_stage_policy, layer_strategies
from lynx.policy.rules import full_layer, keep_all
from lynx.problem import PlanOptions
from lynx.spec import ParallelSpec, load_hardware


def _problem(model: str = "gpt-1.3b", mb: int = 16, budget: float | None = None):  # type: ignore[no-untyped-def]
    par = ParallelSpec(tp=4, pp=4, dp=1, micro_batch_size=mb, global_batch_size=128, seq_length=1024)
    return make_problem(load_model(model), load_hardware("a100-40g-nvlink"), par, PlanOptions(budget_bytes=budget))


def test_strategies_span_full_to_none_and_are_pareto() -> None:
    g = _problem().graph
    st = layer_strategies(g)
    keeps = {s.policy.keep for s in st}
    assert keep_all(g).keep in keeps and full_layer(g).keep in keeps
    assert min(s.recompute_s for s in st) == 0.0
    for a, b in itertools.permutations(st, 2):
        assert not (a.retained <= b.retained and a.work <= b.work and a.recompute_s <= b.recompute_s)
    for s in st:
        assert validate_layer_policy(g, s.policy) == []
        assert all(p == Phase.ON_DEMAND for _, p in s.policy.recompute)


@pytest.mark.parametrize(("layers", "fracs"), [(2, (0.05, 0.3, 0.6)), (3, (0.3,))])
def test_stage_dp_matches_brute_force(layers: int, fracs: tuple[float, ...]) -> None:
    p = _problem()
    g = p.graph
    base = p.stage_context(1, layers)
    st = layer_strategies(g)
    dp = StageDP(g, 4, base.budget_bytes)
    slack = layers * base.in_flight * dp.granule_bytes  # the DP rounds retained bytes up to granules
    lo = stage_peak_bytes(g, (full_layer(g),) * layers, base)
    hi = stage_peak_bytes(g, (keep_all(g),) * layers, base)
    for frac in fracs:
        ctx = dataclasses.replace(base, budget_bytes=lo + frac * (hi - lo))
        brute = math.inf
        brute_tight = math.inf
        for combo in itertools.combinations_with_replacement(st, layers):
            peak = stage_peak_bytes(g, tuple(s.policy for s in combo), ctx)
            t = sum(s.recompute_s for s in combo)
            if peak <= ctx.budget_bytes:
                brute = min(brute, t)
            if peak <= ctx.budget_bytes - slack:
                brute_tight = min(brute_tight, t)
        res = dp.solve(ctx)
        assert res is not None
        t, chosen = res
        assert stage_peak_bytes(g, tuple(s.policy for s in chosen), ctx) <= ctx.budget_bytes
        assert t == pytest.approx(sum(s.recompute_s for s in chosen))
        assert brute - 1e-12 <= t <= brute_tight + 1e-12


def test_partition_dp_matches_enumeration() -> None:
    L, p, m = 11, 4, 8
    # A stage time with memory walls: stage s fits at most 5 - s // 2 layers; the first and last stages carry
    # extra work (embeddings, head), and time grows faster than linearly near the wall (recomputation).
    def stage_time(s: int, n: int) -> float:
        cap = 5 - s // 2
        if n > cap:
            return math.inf
        return n * 1.0 + (0.7 if s in (0, p - 1) else 0.0) + 0.4 * max(0, n - cap + 2) ** 2

    best = min(
        (pipeline_time([stage_time(s, c) for s, c in enumerate(cs)], m), cs)
        for cs in itertools.product(range(1, L + 1), repeat=p) if sum(cs) == L
    )
    part = adapipe_partition(L, p, m, stage_time)
    assert part is not None
    got = pipeline_time([stage_time(s, c) for s, c in enumerate(part.layers_per_stage)], m)
    assert got == pytest.approx(best[0])
    assert adapipe_partition(L, p, m, lambda s, n: math.inf if n > 2 else 1.0) is None


def test_infeasible_reports_the_minimum_budget_per_stage() -> None:
    p = _problem(budget=4.0 * 2**30)
    with pytest.raises(InfeasibleError) as e:
        plan(p, "adapipe")
    mins = e.value.min_budget_bytes
    assert len(mins) == 4 and max(mins) > 4.0 * 2**30
    # A stage given its reported minimum (plus the DP's rounding) does fit.
    ctx = p.stage_context(1, 6)
    dp = StageDP(p.graph, 8, 80.0 * 2**30)
    need = dp.min_budget(ctx)
    ok = dataclasses.replace(ctx, budget_bytes=need + 6 * ctx.in_flight * dp.granule_bytes)
    pol = adapipe_stage_policy(ok, dp)
    assert stage_peak_bytes(p.graph, pol.layers, ok) <= ok.budget_bytes
    with pytest.raises(InfeasibleError):
        adapipe_stage_policy(dataclasses.replace(ctx, budget_bytes=need * 0.99), dp)


def test_plan_is_on_demand_only_and_beats_full() -> None:
    p = _problem(mb=32)
    a = plan(p, "adapipe")
    f = plan(p, "full")
    assert not a.sim.oom
    assert a.sim.iteration_time_s <= f.sim.iteration_time_s
    assert all(ph == Phase.ON_DEMAND for pol in a.result.policies for lp in pol.layers for _, ph in lp.recompute)
    assert all(s.recompute_overlapped_s == 0.0 for s in a.sim.stages)
