"""Lynx-OPT: the phase-indexed MILP proves optimality on one layer, its schedules pass the independent
replay check, the mapped policies are valid and fit in the simulator, and the checker itself can fail."""

from __future__ import annotations

import dataclasses

import pytest

from lynx.api import make_problem, plan
from lynx.cost.memory import stage_peak_bytes
from lynx.decisions import Phase, StageContext, validate_layer_policy
from lynx.errors import InfeasibleError
from lynx.models import load_model
from lynx.policy.opt import OptOptions, solve_stage
from lynx.policy.opt_check import Schedule, check_schedule, policy_to_schedule
from lynx.policy.opt_timeline import build_timeline
from lynx.policy.rules import full_policy, none_policy
from lynx.problem import PlanOptions
from lynx.spec import ParallelSpec, load_hardware


def _problem(model: str = "gpt-300m", mb: int = 32, pp: int = 4, budget: float | None = None,
             lps: tuple[int, ...] | None = None):  # type: ignore[no-untyped-def]
    par = ParallelSpec(tp=4, pp=pp, dp=1, micro_batch_size=mb, global_batch_size=4 * mb, seq_length=1024
                       if model != "gpt-tiny" else 256)
    opts = PlanOptions(budget_bytes=budget, layers_per_stage=lps, time_limit_s=20.0)
    return make_problem(load_model(model), load_hardware("a100-40g-nvlink"), par, opts)


def _ctx(stage: int, layers: int, frac: float) -> tuple[StageContext, object]:
    """A GPT-300M stage whose budget sits `frac` of the way from full recomputation's peak to none's."""
    p = _problem()
    g = p.graph
    ctx = p.stage_context(stage, layers)
    lo = stage_peak_bytes(g, full_policy(ctx, g).layers, ctx)
    hi = stage_peak_bytes(g, none_policy(ctx, g).layers, ctx)
    return dataclasses.replace(ctx, budget_bytes=lo + frac * (hi - lo) + 1.0), g


@pytest.mark.parametrize("frac", [0.1, 0.5])
def test_one_layer_is_proved_optimal_and_valid(frac: float) -> None:
    ctx, g = _ctx(1, 1, frac)
    r = solve_stage(ctx, g, OptOptions(time_limit_s=30))  # type: ignore[arg-type]
    assert r.solution.status == "optimal" and r.policy.stats.status == "optimal"
    assert r.policy.stats.mip_gap == 0.0
    assert r.solution.solve_time_s < 15.0
    assert check_schedule(r.schedule, ctx).ok
    assert r.counts["R"] > 0 and r.counts["F"] > 0 and r.policy.stats.num_variables == r.counts["variables"]
    lp = r.policy.layers[0]
    assert validate_layer_policy(g, lp, ctx.has_fwd_windows) == []  # type: ignore[arg-type]
    assert stage_peak_bytes(g, r.policy.layers, ctx) <= ctx.budget_bytes  # type: ignore[arg-type]
    assert r.critical_s > 0  # the budget forces some recomputation onto the critical path


def test_no_pressure_means_no_recomputation_and_too_little_memory_is_infeasible() -> None:
    ctx, g = _ctx(1, 1, 1.0)
    assert solve_stage(ctx, g, OptOptions(time_limit_s=30)).critical_s == pytest.approx(0.0, abs=1e-9)  # type: ignore[arg-type]
    tight = dataclasses.replace(ctx, budget_bytes=ctx.static_bytes * 1.01)
    with pytest.raises(InfeasibleError):
        solve_stage(tight, g, OptOptions(time_limit_s=30))  # type: ignore[arg-type]


def test_last_stage_has_no_forward_windows() -> None:
    ctx, g = _ctx(3, 1, 0.5)
    r = solve_stage(ctx, g, OptOptions(time_limit_s=30))  # type: ignore[arg-type]
    assert not ctx.has_fwd_windows
    assert all(p not in (Phase.FWD_ATTN, Phase.FWD_MLP) for lp in r.policy.layers for _, p in lp.recompute)
    assert all(st.kind != "host" for st in r.schedule.timeline.stages)


def test_checker_rejects_broken_schedules() -> None:
    ctx, g = _ctx(1, 1, 0.5)
    r = solve_stage(ctx, g, OptOptions(time_limit_s=30))  # type: ignore[arg-type]
    s = r.schedule
    tl = s.timeline
    # Drop every retention into the first backward phase: its backward op reads a tensor that is gone.
    t0 = tl.first_post
    broken = Schedule(tl, s.R, frozenset(k for k in s.S if k[0] != len(tl.stages) - 1 and k[0] != t0))
    assert any("D1" in e or "D2" in e for e in check_schedule(broken, ctx).errors)
    # The same schedule under a smaller budget breaks the memory bound.
    small = dataclasses.replace(ctx, budget_bytes=ctx.budget_bytes * 0.5)
    assert any("M4" in e for e in check_schedule(s, small).errors)
    # A window overfilled beyond its idle time breaks C2.
    win = [t for t, st in enumerate(tl.stages) if st.window is not None]
    over = frozenset((win[0], c.node) for c in tl.candidates(win[0]) if c.in_window)
    assert any("C2" in e for e in check_schedule(Schedule(tl, s.R | over, s.S), ctx).errors)


def test_policy_replay_of_keep_all_and_full() -> None:
    ctx, g = _ctx(1, 2, 1.0)
    tl = build_timeline(g, 2, ctx.has_fwd_windows, True, ctx.subtract_wgrad)  # type: ignore[arg-type]
    for pol in (none_policy(ctx, g), full_policy(ctx, g)):  # type: ignore[arg-type]
        chk = check_schedule(policy_to_schedule(tl, pol.layers), ctx)
        assert chk.ok, chk.errors


def test_plan_fits_in_the_simulator() -> None:
    loose = _problem("gpt-tiny", mb=8, pp=4)
    full = plan(loose, "full").sim
    none = plan(loose, "none").sim
    budget = max(s.peak_memory_bytes for s in full.stages) * 0.5 + max(s.peak_memory_bytes for s in none.stages) * 0.5
    p = _problem("gpt-tiny", mb=8, pp=4, budget=budget)
    times = {}
    for method in ("lynx-opt", "checkmate"):
        pl = plan(p, method)
        assert not pl.sim.oom
        assert all(pol.stats.status == "optimal" for pol in pl.result.policies)
        assert pl.sim.iteration_time_s <= full.iteration_time_s + 1e-12
        times[method] = pl.sim.iteration_time_s
    # The budget forces recomputation, and hiding some of it in windows pays off.
    assert none.iteration_time_s < times["lynx-opt"] < times["checkmate"]


def test_time_limit_returns_the_best_schedule_with_its_gap() -> None:
    ctx, g = _ctx(1, 4, 0.5)  # four layers: far beyond what HiGHS proves in two seconds
    lines: list[str] = []
    r = solve_stage(ctx, g, OptOptions(time_limit_s=2.0, progress=lines.append))  # type: ignore[arg-type]
    assert r.solution.status == "time_limit" and r.policy.stats.status == "time_limit"
    assert r.policy.stats.mip_gap > 0 and "gap" in r.policy.stats.message
    assert check_schedule(r.schedule, ctx).ok
    assert stage_peak_bytes(g, r.policy.layers, ctx) <= ctx.budget_bytes  # type: ignore[arg-type]
    assert lines and "variables" in lines[0]


def test_m5_counts_a_restored_layer_output_whole() -> None:
    """OPT's M5 (the linear bound `memory.linear_peak_bytes` also computes): an R variable of the layer's output op
    weighs its mask (`keep_bytes`) plus the output itself in the backward working-set rows, as the lifetime
    rule's transient sample sees it; every other op weighs its `keep_bytes`."""
    from lynx.policy.opt_model import MIB, build

    ctx, g = _ctx(1, 2, 0.5)
    tl = build_timeline(g, 2, ctx.has_fwd_windows, True)  # type: ignore[arg-type]
    om = build(tl, ctx)
    out_op = g.op(g.output_op)  # type: ignore[attr-defined]
    assert out_op.mask_bytes > 0  # GPT's residual dropout: rebuilt for its mask
    w = om.milp.names.index("W")
    wb_rows = [terms for lb, terms, ub in om.milp.rows if terms.get(w) == 1.0 and lb == 0.0]
    assert wb_rows
    seen = 0
    for (t, v), r in om.R.items():
        coefs = {-terms[r] for terms in wb_rows if r in terms}
        if not coefs:
            continue
        want = tl.mem(v) + (out_op.out_bytes if tl.op_of(v) == tl.n_ops - 1 else 0.0)
        assert all(c == pytest.approx(want / MIB) for c in coefs), (t, v, coefs, want / MIB)
        seen += tl.op_of(v) == tl.n_ops - 1
    assert seen > 0
