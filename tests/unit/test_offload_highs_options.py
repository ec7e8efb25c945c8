"""Decision 0252. The offloading models are solved without HiGHS's RINS and RENS sub-MIP heuristics
(`OFFLOAD_HIGHS_OPTIONS`): the options reach HiGHS, only the offloading method's models get them, and a stage solved
with them stays within the offloading gap of the one solved with HiGHS's defaults."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

import lynx.milp as milp
from lynx.methods.common import base_partition
from lynx.methods.heu import heu_options
from lynx.milp import Milp
from lynx.models import load_model
from lynx.policy.heu import OFFLOAD_HIGHS_OPTIONS, OFFLOAD_MAX_NODES, OFFLOAD_MIP_GAP, solve_stage
from lynx.problem import PlanOptions
from lynx.search.evaluate import Shared
from lynx.search.space import Layout, Space
from lynx.spec import load_hardware


def _problem():  # type: ignore[no-untyped-def]
    """A 70B finalist of the 64-GPU search: interleaved, FSDP, offloading (as test_refine_plain.py)."""
    hw = load_hardware("h100-80g-nvlink")
    space = Space(load_model("llama3-70b"), hw, 64, 128, 8192, offload=True)
    lay = Layout(tp=4, pp=4, vpp=7, dp=4, sp=True, mb=2, dist_opt=False, fsdp=True)
    return Shared(space, PlanOptions(precision="megatron-bf16")).problem(lay, None)


def _knapsack() -> Milp:
    m = Milp()
    xs = [m.binary(f"x{i}", cost=-float(i + 1)) for i in range(6)]
    m.le({x: float(i + 2) for i, x in enumerate(xs)}, 9.0)
    return m


def test_the_offloading_method_alone_runs_without_rins_and_rens() -> None:
    problem = _problem()
    assert dict(OFFLOAD_HIGHS_OPTIONS) == {"mip_heuristic_run_rins": False, "mip_heuristic_run_rens": False,
                                           "mip_max_nodes": OFFLOAD_MAX_NODES}
    assert heu_options(problem, "lynx-offload").highs_options == OFFLOAD_HIGHS_OPTIONS
    assert heu_options(problem, "lynx").highs_options == ()


def test_highs_options_reach_highs(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Any] = []
    real = milp._new_highs

    def recording() -> Any:
        h = real()
        made.append(h)
        return h

    monkeypatch.setattr(milp, "_new_highs", recording)
    plain = _knapsack().solve()
    tuned = _knapsack().solve(highs_options=OFFLOAD_HIGHS_OPTIONS)
    assert plain.objective == tuned.objective == -7.0  # e.g. weights 4 + 5, values 3 + 4
    assert made[0].getOptionValue("mip_heuristic_run_rins")[1] is True  # HiGHS's default
    for name, value in OFFLOAD_HIGHS_OPTIONS:
        assert made[1].getOptionValue(name)[1] == value
    with pytest.raises(ValueError, match="no_such_option"):
        _knapsack().solve(highs_options=(("no_such_option", True),))


def test_offloading_stages_without_the_sub_mips_stay_within_the_gap() -> None:
    problem = _problem()
    opts = heu_options(problem, "lynx-offload")
    for ctx in problem.stage_contexts(base_partition(problem)):
        fast = solve_stage(ctx, problem.graph, opts, explain=False)  # validates the policy and its peak
        default = solve_stage(ctx, problem.graph, replace(opts, highs_options=()), explain=False)
        assert any(lp.offload for lp in fast.layers)
        f, d = fast.stats.objective, default.stats.objective
        assert abs(f - d) <= OFFLOAD_MIP_GAP * max(f, d), (ctx.stage, f, d)


def test_a_node_cap_returns_the_incumbent_as_a_limited_solve() -> None:
    """A model stopped by its node cap (HiGHS: "solution limit reached") keeps its incumbent as a solution with its
    gap, as one stopped by the time limit does: the same answer on every machine."""
    import random

    r = random.Random(1)  # a 3-constraint knapsack of 60 items: no HiGHS version closes it at the root
    m = Milp()
    xs = [m.binary(f"x{i}", cost=-r.randint(50, 100)) for i in range(60)]
    for _ in range(3):
        m.le({x: float(r.randint(20, 60)) for x in xs}, 600.0)
    full = m.solve(mip_gap=0.0)
    capped = m.solve(mip_gap=0.0, highs_options=(("mip_max_nodes", 2),))
    assert full.status == "optimal"
    assert capped.status == "time_limit" and capped.has_solution and capped.mip_gap > 0
    assert capped.objective >= full.objective - 1e-9
