"""Checkmate: the same program as Lynx-OPT without windows (one model builder, a flag)."""

from __future__ import annotations

import pytest
from test_opt import _ctx

from lynx.decisions import Phase
from lynx.policy.opt import OptOptions, checkmate_options, solve_stage
from lynx.policy.opt_check import check_schedule
from lynx.policy.opt_timeline import build_timeline


def test_uses_windows_and_beats_checkmate() -> None:
    ctx, g = _ctx(1, 1, 0.5)
    opt = solve_stage(ctx, g, OptOptions(time_limit_s=30))  # type: ignore[arg-type]
    cm = solve_stage(ctx, g, checkmate_options(30))  # type: ignore[arg-type]
    assert cm.solution.status == "optimal"
    assert all(p == Phase.ON_DEMAND for lp in cm.policy.layers for _, p in lp.recompute)
    assert any(p != Phase.ON_DEMAND for lp in opt.policy.layers for _, p in lp.recompute)
    assert opt.critical_s < cm.critical_s - 1e-6
    assert cm.counts["variables"] < opt.counts["variables"]  # no window phases in Checkmate's timeline


def test_checkmate_timeline_has_no_windows_and_passes_the_replay() -> None:
    ctx, g = _ctx(0, 1, 0.3)
    tl = build_timeline(g, 1, ctx.has_fwd_windows, False, ctx.subtract_wgrad)  # type: ignore[arg-type]
    assert all(st.window is None and st.kind != "host" for st in tl.stages)
    r = solve_stage(ctx, g, checkmate_options(30))  # type: ignore[arg-type]
    assert r.policy.method == "checkmate" and not r.policy.cooldown_overlap
    assert check_schedule(r.schedule, ctx).ok
    # Every recomputation costs time: the objective is the on-demand recompute time of the policy.
    lp = r.policy.layers[0]
    assert r.critical_s == pytest.approx(sum(g.op(n).fwd_time for n, _ in lp.recompute))  # type: ignore[attr-defined]


def test_cli_plans_with_checkmate_and_lynx_opt() -> None:
    from typer.testing import CliRunner

    from lynx.cli import app

    args = ["plan", "-m", "gpt-tiny", "--tp", "4", "--pp", "4", "--micro-batch", "8", "--global-batch", "32",
            "--seq-len", "256", "--budget-gb", "0.048", "--time-limit", "20", "--json"]
    for method in ("checkmate", "lynx-opt"):
        r = CliRunner().invoke(app, [*args, "--method", method])
        assert r.exit_code == 0, r.output
        assert f'"{method}"' in r.output and '"status": "optimal"' in r.output
