"""The simulator as an interpreter of any valid action list: interleaved 1F1B, GPipe, a user's schedule."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lynx.api import make_problem
from lynx.cost.memory import stage_peak_bytes
from lynx.methods.common import stage_policy
from lynx.partition.base import Partition
from lynx.policy.rules import block_policy, full_policy, none_policy, selective_policy, uniform_policy
from lynx.problem import PlanOptions, PlanProblem
from lynx.schedule import make_schedule, schedule_1f1b, schedule_gpipe
from lynx.simulate import simulate
from lynx.spec import ModelSpec, ParallelSpec, load_hardware

RULES = (none_policy, full_policy, selective_policy, uniform_policy, block_policy)


@st.composite
def interleaved(draw: st.DrawFn, equal: bool = False) -> tuple[PlanProblem, Partition]:
    pp = draw(st.integers(2, 4))
    v = draw(st.integers(2, 3))
    m = pp * draw(st.integers(1, 3))
    per = [draw(st.integers(1, 2)) for _ in range(pp * v)] if not equal else [draw(st.integers(1, 2))] * (pp * v)
    heads = draw(st.sampled_from([8, 16]))
    model = ModelSpec("m", sum(per), heads * 64, heads, vocab_size=8192)
    tp = draw(st.sampled_from([1, 2]))
    par = ParallelSpec(tp=tp, pp=pp, micro_batch_size=2, global_batch_size=2 * m, seq_length=512)
    opts = PlanOptions(include_dp_allreduce=False, include_edges=not equal, nodes=16, vpp=v)
    prob = make_problem(model, load_hardware("a100-40g-nvlink"), par, opts)
    return prob, Partition.interleaved(tuple(per), pp)


def _policies(prob: PlanProblem, part: Partition, fn):  # type: ignore[no-untyped-def]
    return tuple(stage_policy(fn, c, prob.graph) for c in prob.stage_contexts(part))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(interleaved(equal=True), st.sampled_from(RULES))
def test_interleaved_bubble_with_equal_chunks(case: tuple[PlanProblem, Partition], fn) -> None:  # type: ignore[no-untyped-def]
    prob, part = case
    p, m, v = prob.parallel.pp, prob.parallel.num_microbatches, prob.options.vpp
    r = simulate(prob, part, _policies(prob, part, fn), p2p_s=0.0)
    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(interleaved(), st.sampled_from(RULES))
def test_interleaved_makespan_memory_and_bounds(case: tuple[PlanProblem, Partition], fn) -> None:  # type: ignore[no-untyped-def]
    prob, part = case
    pols = _policies(prob, part, fn)
    r = simulate(prob, part, pols)
    assert r.pipeline_time_s >= max(s.busy_time_s for s in r.stages) - 1e-12
    for s, ctx in zip(r.stages, prob.stage_contexts(part), strict=True):
        curve = r.memory_curves[s.stage]
        assert min(b for _, b in curve) >= ctx.static_bytes - 1e-6
        assert curve[-1][1] == pytest.approx(ctx.static_bytes, rel=1e-9, abs=1.0)
        assert s.peak_memory_bytes <= stage_peak_bytes(prob.graph, pols[s.stage].layers, ctx) * (1 + 1e-9)


def _flat(pp: int, m: int) -> tuple[PlanProblem, Partition]:
    model = ModelSpec("m", 2 * pp, 512, 8, vocab_size=8192)
    par = ParallelSpec(tp=2, pp=pp, micro_batch_size=2, global_batch_size=2 * m, seq_length=512)
    opts = PlanOptions(include_dp_allreduce=False, include_edges=False, nodes=16)
    return make_problem(model, load_hardware("a100-40g-nvlink"), par, opts), Partition((2,) * pp)


@given(pp=st.integers(1, 4), m=st.integers(1, 8))
@settings(max_examples=30, deadline=None)
def test_gpipe_bubble_and_memory(pp: int, m: int) -> None:
    """GPipe has 1F1B's bubble with equal stages, but holds every micro-batch at once."""
    prob, part = _flat(pp, m)
    pols = _policies(prob, part, none_policy)
    g = simulate(prob, part, pols, p2p_s=0.0, schedule=schedule_gpipe(pp, m))
    f = simulate(prob, part, pols, p2p_s=0.0)
    assert g.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-9)
    assert g.stages[0].peak_memory_bytes >= f.stages[0].peak_memory_bytes


def test_default_schedule_is_the_problems_own() -> None:
    prob, part = _flat(4, 8)
    pols = _policies(prob, part, selective_policy)
    assert simulate(prob, part, pols, schedule=schedule_1f1b(4, 8)) == simulate(prob, part, pols)
    inter = dataclasses.replace(prob, options=dataclasses.replace(prob.options, vpp=2))
    part2 = Partition.interleaved((1,) * 8, 4)
    pols2 = _policies(inter, part2, selective_policy)
    assert simulate(inter, part2, pols2, schedule=make_schedule(4, 8, 2)) == simulate(inter, part2, pols2)
    with pytest.raises(ValueError, match="chunks"):
        simulate(prob, part, pols, schedule=make_schedule(4, 8, 2))
