"""The replay-free floor `lynx export megatron` checks before simulating a per-stage setting
(`export.pricing._RankFloor`): it never exceeds the peak the simulator replays for that rank, so a setting it
refuses could not fit, and the plugin's choice is the one the simulation alone makes."""

from __future__ import annotations

import pytest

from lynx.export.layout import ChunkLayout
from lynx.export.megatron_recompute import candidates
from lynx.export.pricing import _RankFloor, fastest_fitting, simulate_per_stage
from lynx.spec import GiB
from tests.conftest import problem_for

CASES = [
    pytest.param(dict(), ChunkLayout(4, 1, (8, 8, 8, 8)), id="gpt-7b-1f1b"),
    pytest.param(dict(mb=4), ChunkLayout(4, 2, (4, 4, 4, 4, 4, 4, 4, 4)), id="gpt-7b-interleaved"),
    pytest.param(dict(model="llama2-7b", hardware="h100-80g-nvlink", tp=2, sp=True, seq=2048),
                 ChunkLayout(4, 1, (7, 9, 9, 7)), id="llama2-7b-uneven"),
]


@pytest.mark.parametrize(("opts", "layout"), CASES)
def test_floor_never_exceeds_the_simulated_peak(opts: dict[str, object], layout: ChunkLayout) -> None:
    problem = problem_for(**opts)  # type: ignore[arg-type]
    floor = _RankFloor(problem, layout, None)
    g = problem.graph
    checked = 0
    for rank in range(layout.pp):
        for rec in candidates(g, max(layout.layers))[::3]:  # cheap to frugal, block and uniform N included
            if any(rec.num_layers is not None and rec.num_layers > n for n in layout.layers):
                continue
            settings = [rec] * len(layout.layers)
            peak = simulate_per_stage(problem, layout, settings).stages[rank].peak_bytes
            assert floor.bytes(settings, rank) <= peak, (rank, rec.short())
            checked += 1
    assert checked >= 8


def test_fastest_fitting_is_the_simulations_choice() -> None:
    """Under a budget where the cheapest settings do not fit, the floor-first search picks what trying every
    setting by simulation picks."""
    problem = problem_for(mb=8, budget_bytes=14 * GiB)
    layout = ChunkLayout(4, 1, (8, 8, 8, 8))
    g = problem.graph
    chosen, found = fastest_fitting(problem, layout, [candidates(g, 8)[0]] * 4)
    assert all(found)
    for r in range(4):
        for rec in candidates(g, 8):
            trial = [*chosen[:r], rec, *chosen[r + 1:]]
            if simulate_per_stage(problem, layout, trial).stages[r].fits:
                assert rec == chosen[r], (r, rec.short(), chosen[r].short())
                break


def _one_rank_at_a_time(problem, layout, start):  # noqa: ANN001, ANN202
    """The plugin's per-stage choice by simulation alone, one rank and one chunk after another (the reference the
    floor-first, side-by-side search must reproduce)."""
    from lynx.export.megatron_recompute import recompute_cost

    g, pp = problem.graph, layout.pp
    chosen, found = list(start), [False] * len(start)

    def fits(trial, r):  # noqa: ANN001, ANN202
        return simulate_per_stage(problem, layout, trial).stages[r].fits

    for r in range(pp):
        vs = [c * pp + r for c in range(layout.vpp)]
        pool = {c for v in vs for c in candidates(g, layout.layers[v])}
        for cand in sorted(pool, key=lambda c: (sum(recompute_cost(g, c, layout.layers[v]) for v in vs), c.short())):
            trial = [cand if i in vs else x for i, x in enumerate(chosen)]
            if fits(trial, r):
                chosen, found = trial, [f or i in vs for i, f in enumerate(found)]
                break
        for v in vs if layout.vpp > 1 and found[vs[0]] else []:
            n = layout.layers[v]
            for cand in candidates(g, n):
                if recompute_cost(g, cand, n) >= recompute_cost(g, chosen[v], n):
                    break
                trial = [*chosen[:v], cand, *chosen[v + 1:]]
                if fits(trial, r):
                    chosen = trial
                    break
    return chosen, found


@pytest.mark.parametrize(("opts", "layout"), [
    pytest.param(dict(mb=8, budget_bytes=14 * GiB), ChunkLayout(4, 1, (8, 8, 8, 8)), id="1f1b"),
    pytest.param(dict(mb=4, budget_bytes=11 * GiB), ChunkLayout(4, 2, (4, 4, 4, 4, 4, 4, 4, 4)), id="interleaved"),
])
def test_side_by_side_search_equals_one_rank_at_a_time(opts: dict[str, object], layout: ChunkLayout) -> None:
    problem = problem_for(**opts)  # type: ignore[arg-type]
    start = [candidates(problem.graph, n)[0] for n in layout.layers]
    got = fastest_fitting(problem, layout, start)
    assert got == _one_rank_at_a_time(problem, layout, start)
    assert len({s.short() for s in got[0]}) > 1  # the budget makes the stages choose differently
