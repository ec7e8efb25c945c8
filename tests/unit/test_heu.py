"""Lynx-HEU on analytic layer graphs: validity, memory, phases, pricing agreement with the simulator, the
cache, mixed policies and `lynx solve`."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

import lynx.cli.solve  # noqa: F401  (registers `lynx solve` on the app)
from lynx.api import make_problem, plan
from lynx.cli import app
from lynx.cost.memory import stage_peak_bytes
from lynx.decisions import FWD_PHASES, LayerPolicy, Phase, StageContext, check_policy
from lynx.errors import InfeasibleError
from lynx.methods import available_methods, base_partition
from lynx.models import load_model
from lynx.policy.heu import HeuCache, critical_recompute, heu_policy
from lynx.policy.heu_mixed import mixed_policy
from lynx.problem import PlanOptions, PlanProblem
from lynx.spec import GiB, ParallelSpec, load_hardware


def problem(model: str = "gpt-7b", hw: str = "a100-40g-nvlink", tp: int = 4, mb: int = 16,
            opts: PlanOptions | None = None) -> PlanProblem:
    par = ParallelSpec(tp=tp, pp=4, dp=1, micro_batch_size=mb, global_batch_size=16 * mb, seq_length=1024)
    return make_problem(load_model(model), load_hardware(hw), par, opts)


def test_methods_registered() -> None:
    assert {"lynx", "lynx-heu", "lynx-mixed"} <= set(available_methods())


@pytest.mark.parametrize("hw,tp", [("a100-40g-nvlink", 4), ("a100-40g-pcie", 2)])
def test_stage_policies_valid_and_fit(hw: str, tp: int) -> None:
    p = problem("gpt-13b", hw, tp, 16)
    for ctx in p.stage_contexts(base_partition(p)):
        pol = heu_policy(ctx, p.graph)
        check_policy(p.graph, pol, ctx)
        assert stage_peak_bytes(p.graph, pol.layers, ctx) <= ctx.budget_bytes * (1 + 1e-9)
        assert pol.stats.status == "optimal"
        if pol.stats.solver == "closed-form":  # keeping everything fits: nothing to solve
            assert all(lp.keep == p.graph.needed() and not lp.recompute for lp in pol.layers)
        else:
            assert pol.stats.num_variables > 0 and pol.stats.num_constraints > 0
        for lp in pol.layers:
            for name, ph in lp.recompute:
                if p.graph.op(name).is_comm:  # eq. (6)
                    assert ph == Phase.ON_DEMAND
                if not ctx.has_fwd_windows:  # last stage: phases 3, 4, 5 only
                    assert ph not in FWD_PHASES


def test_windows_respected_and_idle_part_only() -> None:
    p = problem("gpt-13b", "a100-40g-pcie", 2, 16)
    g = p.graph
    ctx = p.stage_contexts(base_partition(p))[1]
    caps = {Phase.FWD_ATTN: g.fwd_window("attn"), Phase.FWD_MLP: g.fwd_window("mlp"),
            Phase.BWD_MLP: g.bwd_window("mlp", True), Phase.BWD_ATTN: g.bwd_window("attn", True)}
    lp = heu_policy(ctx, g).layers[0]
    for ph, cap in caps.items():  # eq. (5)
        assert sum(g.op(n).fwd_time for n in lp.recomputed((ph,))) <= cap * (1 + 1e-9)
    # Without the wgrad subtraction the backward windows are larger, so the optimum can only improve.
    whole = heu_policy(dataclasses.replace(ctx, subtract_wgrad=False), g)
    assert whole.stats.objective <= heu_policy(ctx, g).stats.objective + 1e-12
    assert g.bwd_window("mlp", False) >= g.bwd_window("mlp", True)


def test_more_budget_never_hurts() -> None:
    p = problem("gpt-7b", mb=32)
    ctx = p.stage_contexts(base_partition(p))[0]
    objs = [heu_policy(dataclasses.replace(ctx, budget_bytes=ctx.budget_bytes * f), p.graph).stats.objective
            for f in (0.8, 0.9, 1.0, 1.2)]
    assert objs == sorted(objs, reverse=True)


def test_top_layer_has_no_backward_window() -> None:
    """A one-layer stage: phase 3/4 work of its only (top) layer is priced as on demand, as the simulator
    charges it."""
    p = problem()
    ctx = dataclasses.replace(p.stage_contexts(base_partition(p))[3], num_layers=1)
    g = p.graph
    lp3 = LayerPolicy(frozenset(g.needed() - {"gelu"}), (("gelu", Phase.BWD_MLP),))
    lp5 = LayerPolicy(frozenset(g.needed() - {"gelu"}), (("gelu", Phase.ON_DEMAND),))
    c = g.op("gelu").fwd_time
    assert critical_recompute(g, (lp3,), ctx) == pytest.approx(c)
    assert critical_recompute(g, (lp5,), ctx) == pytest.approx(c)
    assert critical_recompute(g, (lp3, lp3), dataclasses.replace(ctx, num_layers=2)) == pytest.approx(
        c + max(0.0, c - g.bwd_window("mlp", ctx.subtract_wgrad)))


@pytest.mark.parametrize("cooldown", [True, False])
def test_pricing_agrees_with_simulator(cooldown: bool) -> None:
    """m x critical_recompute == the simulator's critical recomputation, on every stage (with cool-down
    overlap the stalls may hide more than nothing, so the simulator is <=)."""
    p = problem("gpt-13b", "a100-40g-pcie", 2, 8, PlanOptions(cooldown_overlap=cooldown))
    pl = plan(p, "lynx")
    m = p.parallel.num_microbatches
    for ctx, pol, st in zip(p.stage_contexts(pl.result.partition), pl.result.policies, pl.sim.stages, strict=True):
        assert pol.cooldown_overlap == cooldown
        want = m * critical_recompute(p.graph, pol.layers, ctx, cooldown)
        if cooldown:
            assert st.recompute_critical_s >= want - 1e-9
            # at worst every micro-batch also pays its phase-1/2 work on demand
            assert st.recompute_critical_s <= want + m * critical_recompute(
                p.graph, tuple(_fwd_as_demand(lp) for lp in pol.layers), ctx) + 1e-9
        else:
            assert st.recompute_critical_s == pytest.approx(want, rel=1e-9, abs=1e-12)


def _fwd_as_demand(lp: LayerPolicy) -> LayerPolicy:
    return LayerPolicy(lp.keep, tuple((n, Phase.ON_DEMAND) for n, ph in lp.recompute if ph in FWD_PHASES))


def test_cache_hits_per_key() -> None:
    p = problem()
    cache = HeuCache(p.graph)
    ctx = p.stage_context(1, 8)
    a, b = cache.get(ctx), cache.get(dataclasses.replace(ctx))
    assert a is b and cache.solves == 1 and cache.hits == 1
    cache.get(p.stage_context(1, 9))
    assert cache.solves == 2
    tiny = dataclasses.replace(ctx, budget_bytes=ctx.static_bytes)
    assert isinstance(cache.get(tiny), InfeasibleError)


def test_mixed_never_worse_and_fits() -> None:
    p = problem("gpt-13b", "a100-40g-pcie", 2, 16)
    for ctx in p.stage_contexts(base_partition(p))[1:3]:
        single, mixed = heu_policy(ctx, p.graph), mixed_policy(ctx, p.graph)
        check_policy(p.graph, mixed, ctx)
        assert mixed.stats.objective <= single.stats.objective + 1e-12
        assert stage_peak_bytes(p.graph, mixed.layers, ctx) <= ctx.budget_bytes * (1 + 1e-9)


def test_infeasible_names_min_budget_per_stage() -> None:
    p = problem("gpt-7b", opts=PlanOptions(budget_bytes=9 * GiB))
    with pytest.raises(InfeasibleError) as e:
        plan(p, "lynx-heu")
    assert len(e.value.min_budget_bytes) == 4 and all(b > 9 * GiB for b in e.value.min_budget_bytes[:1])
    assert "stage 0" in str(e.value) and "needs" in str(e.value)
    ok = problem("gpt-7b", opts=PlanOptions(budget_bytes=max(e.value.min_budget_bytes) * 1.001))
    assert not plan(ok, "lynx-heu").sim.oom


def test_cli_solve(tmp_path: Path) -> None:
    g = problem().graph
    f = tmp_path / "layer.json"
    f.write_text(g.to_json())
    runner = CliRunner()
    r = runner.invoke(app, ["solve", "--graph", str(f), "--layers", "8", "--in-flight", "4",
                            "--budget-gb", "20", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["num_variables"] > 0 and d["peak_bytes"] <= 20 * GiB and d["forward_windows"] is True
    assert d["policy"]["layers"][0]["count"] == 8
    r = runner.invoke(app, ["solve", "--graph", str(f), "--layers", "8", "--in-flight", "1", "--budget-gb", "20",
                            "--last-stage", "--json"])
    d = json.loads(r.output)
    assert d["forward_windows"] is False
    assert not any(v in ("recompute:1", "recompute:2") for v in d["policy"]["layers"][0]["ops"].values())
    r = runner.invoke(app, ["solve", "--graph", str(f), "--layers", "8", "--in-flight", "4", "--budget-gb", "1"])
    assert r.exit_code != 0


def test_stage_context_roundtrip_fields() -> None:
    ctx = StageContext(0, 4, 8, 4, 16, 40 * GiB, 6 * GiB)
    assert ctx.has_fwd_windows and not dataclasses.replace(ctx, stage=3).has_fwd_windows


def test_floor_is_below_heu_and_cached_per_fsdp_charge() -> None:
    """`demand_floor` (the search's screen bounds) is at most HEU's optimum where memory binds, and positive there;
    an FSDP window long enough to hide the on-demand work takes it to 0, so the cache keys the two apart (a stage
    problem that differs only in FSDP's charges is another problem, for HEU's objective and for the floor)."""
    from lynx.decisions import FsdpCharge

    p = problem()
    cache = HeuCache(p.graph)
    ctx = p.stage_context(1, 8)
    tight = dataclasses.replace(ctx, budget_bytes=ctx.budget_bytes - 0.5 * ctx.activation_budget_bytes)
    floor = cache.floor(tight)
    assert 0 < floor <= heu_policy(tight, p.graph).stats.objective
    hidden = dataclasses.replace(tight, fsdp=FsdpCharge(gather_bwd_s=10.0))
    assert cache.key(hidden) != cache.key(tight)
    assert cache.floor(hidden) == 0.0 and cache.floor(tight) == floor


def test_a_floor_lp_of_bytes_beside_seconds_is_solved_on_its_first_try(monkeypatch: pytest.MonkeyPatch) -> None:
    """The floor LPs mix bytes (up to ~1e11) with seconds and indicators (~1e-4) in their rows. Solved as built,
    HiGHS ended some in an error, at a limit, or after seconds, and the floor came back 0 (decision 0259).
    `demand_floor` solves them row-scaled (`Milp.row_scaled`): this
    stage's relaxation (405B, TP 4 CP 2 PP 8 VPP 8, lynx-offload, stage 2) ends optimal on the first try, with the
    optimum the unscaled model reaches by simplex and by interior point."""
    import lynx.milp as milp
    from lynx.policy.heu import build_model, demand_floor
    p, cache = _offload_405b_stages()
    ctx = p.stage_contexts(base_partition(p))[2]
    statuses: list[str] = []
    solve = milp.Milp.solve

    def kept(self: milp.Milp, *a: object, **kw: object) -> milp.MilpSolution:
        sol = solve(self, *a, **kw)  # type: ignore[arg-type]
        statuses.append(sol.status)
        return sol

    monkeypatch.setattr(milp.Milp, "solve", kept)
    floor = demand_floor(ctx, cache.graphs(ctx), cache.opts)
    assert statuses == ["optimal"] and floor > 0
    m, _, _ = build_model(cache.graphs(ctx), ctx, cache.opts, floor=True)
    m.integer = [False] * m.num_variables
    plain = solve(m, 10.0, 1e-6)
    ipm = solve(m, 10.0, 1e-6, highs_options=(("solver", "ipm"),))  # another algorithm on the unscaled model
    scaled = solve(m.row_scaled(), 10.0, 1e-6)
    assert plain.status == ipm.status == scaled.status == "optimal"
    assert scaled.objective == pytest.approx(plain.objective, rel=1e-6) == pytest.approx(ipm.objective, rel=1e-6)


def test_row_scaling_refuses_a_coefficient_highs_would_drop() -> None:
    """HiGHS treats a coefficient below its small_matrix_value (1e-9) as zero. Scaled to its largest coefficient, a
    row of bytes with a unit term would lose that term: the solve would be of another model (an offloading stage's D
    in bytes let a policy overflow its budget by 0.3 GiB, decision 0271). `row_scaled` refuses such a row."""
    import lynx.milp as milp

    m = milp.Milp()
    big, d = m.binary("keep"), m.var("D", lb=-math.inf)
    m.le({big: 7e9, d: 1.0}, 3e10)
    with pytest.raises(ValueError, match="D fall below HiGHS's small_matrix_value"):
        m.row_scaled()
    m.rows[0] = (-math.inf, {big: 7e9, d: 2.0**30}, 3e10)  # D in GiB: kept
    assert m.row_scaled().rows[0][1][d] == pytest.approx(2.0**30 / 7e9)


def test_an_offloading_interleaved_stage_keeps_d_and_its_floor_stays_below_heu() -> None:
    """An interleaved lynx-offload stage's model carries D (the held bytes beyond the first live vector), in GiB so
    that row scaling keeps it; its HEU policy fits the budget (the solve checks it) and the LP floor the search
    bounds with is at most the optimum, where memory binds (405B, TP 4 CP 2 PP 8 VPP 8, stages 1 and 2)."""
    from lynx.policy.heu import build_model, demand_floor, solve_stage
    p, cache = _offload_405b_stages()
    for ctx in p.stage_contexts(base_partition(p))[1:3]:
        m, _, _ = build_model(cache.graphs(ctx), ctx, cache.opts)
        assert "D" in m.names
        m.row_scaled()  # no coefficient lost (it raises otherwise)
        floor = demand_floor(ctx, cache.graphs(ctx), cache.opts)
        pol = solve_stage(ctx, cache.graphs(ctx), cache.opts, explain=False)  # asserts its peak fits
        assert 0 < floor <= pol.stats.objective


def _offload_405b_stages() -> tuple[PlanProblem, HeuCache]:
    """Llama-3.1-405B on 1,024 H100, TP 4 CP 2 PP 8 VPP 8 DP 16, micro-batch 2: the layout's problem and its
    lynx-offload stage-problem cache, as the search builds them (an interleaved offloading stage model, with D)."""
    from lynx.search import Pins, Space
    from lynx.search.evaluate import Shared
    from lynx.search.space import Layout

    space = Space(load_model("llama3.1-405b"), load_hardware("h100-80g-nvlink"), 1024, 1024, 8192, Pins(),
                  offload=True)
    shared = Shared(space, PlanOptions())
    lay = Layout(tp=4, pp=8, vpp=8, dp=16, sp=True, mb=2, dist_opt=True, cp=2)
    p = shared.problem(lay, None)
    return p, shared.heu_cache(p, lay, "lynx-offload")
