"""The replay-free memory floor (`memory.stage_floor_bytes`) that lets Megatron's block scan skip the activation
replay: it never exceeds the stage peak, and block's N is the one the full scan on the peak picks."""

from __future__ import annotations

import pytest

from lynx.cost.memory import layer_memories, stage_floor_bytes, stage_peak_bytes
from lynx.decisions import StageContext
from lynx.methods import get_method
from lynx.methods.common import megatron_partition, stage_policy
from lynx.policy.rules import block_policy, full_policy, none_policy, selective_policy, uniform_policy
from lynx.problem import PlanProblem
from tests.conftest import problem_for

PROBLEMS = [
    problem_for(mb=16),
    problem_for(mb=4, pp=2, tp=2),
    problem_for(model="gpt-13b", tp=2, pp=4, mb=4, gb=64, seq=2048, sp=True, vpp=2),
]


def _block_n_by_full_scan(problem: PlanProblem) -> int:
    """The scan before the floor: every N's closed-form peak, smallest N that fits every stage."""
    part = megatron_partition(problem)
    ctxs = problem.stage_contexts(part)
    n = max(part.layers_per_stage)
    for cand in range(n + 1):
        pols = [stage_policy(lambda c, g, k=cand: block_policy(c, g, k), c, problem.graphs_for(c)) for c in ctxs]
        if all(stage_peak_bytes(problem.graphs_for(c), p.layers, c) <= c.budget_bytes
               for p, c in zip(pols, ctxs, strict=True)):
            return cand
    return n


def _contexts(problem: PlanProblem) -> tuple[StageContext, ...]:
    return problem.stage_contexts(megatron_partition(problem))


@pytest.mark.parametrize("i", range(len(PROBLEMS)))
def test_floor_never_exceeds_the_peak(i: int) -> None:
    problem = PROBLEMS[i]
    fns = [none_policy, full_policy, selective_policy, lambda c, g: uniform_policy(c, g, 2)]
    fns += [lambda c, g, k=k: block_policy(c, g, k) for k in range(0, 9, 2)]
    for ctx in _contexts(problem):
        g = problem.graphs_for(ctx)
        for fn in fns:
            pol = stage_policy(fn, ctx, g)
            floor = stage_floor_bytes(layer_memories(g, pol.layers), ctx)
            peak = stage_peak_bytes(g, pol.layers, ctx)
            assert floor <= peak
            assert floor >= ctx.static_bytes  # it holds what the stage stores at least


@pytest.mark.parametrize("i", range(len(PROBLEMS)))
def test_block_picks_the_n_of_the_full_scan(i: int) -> None:
    problem = PROBLEMS[i]
    res = get_method("block").fn(problem)
    assert res.notes == (f"--recompute-num-layers {_block_n_by_full_scan(problem)}",)


def test_graph_lookups_follow_the_ops() -> None:
    """`LayerGraph`'s lookups are built from its ops once: a replaced graph gets its own, an unknown op is a
    KeyError as before."""
    import dataclasses

    g = PROBLEMS[0].graph
    assert g.names == tuple(o.name for o in g.ops)
    assert all(g.op(o.name) is o for o in g.ops)
    with pytest.raises(KeyError):
        g.op("no-such-op")
    last = dataclasses.replace(g.ops[-1], out_bytes=2 * g.ops[-1].out_bytes)
    h = dataclasses.replace(g, ops=(*g.ops[:-1], last))
    assert h.op(last.name) is last and g.op(last.name) is g.ops[-1] and h.op(last.name) != g.op(last.name)
    assert h.needed() == g.needed() == frozenset(s for o in g.ops for s in o.saved if s != "input")
