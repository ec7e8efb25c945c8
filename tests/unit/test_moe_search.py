"""The configuration search over expert parallelism (`lynx.search.experts`): Megatron-Core's rules decide the
(EP, ETP) pairs of each layout."""

from __future__ import annotations

import pytest

from lynx.models import load_model
from lynx.search import Pins, Space
from lynx.search.experts import expert_values
from lynx.search.space import layouts
from lynx.spec import load_hardware

H100 = load_hardware("h100-80g-nvlink")


def test_dense_models_search_no_expert_parallelism() -> None:
    sp = Space(load_model("llama3-8b"), H100, 16, 64, 4096)
    assert expert_values(sp.model, None, None, 2, 1, 8) == [(1, 0)]
    assert all(lay.ep == 1 and lay.etp == 0 for lay in layouts(sp)[0])


def test_moe_pairs_follow_megatrons_folding() -> None:
    sp = Space(load_model("mixtral-8x7b"), H100, 64, 256, 4096)
    pairs = expert_values(sp.model, None, None, 2, 1, 4)  # 8 ranks per stage, 8 experts
    assert (1, 0) in pairs and (4, 0) in pairs and (8, 1) in pairs
    assert (8, 0) not in pairs  # ETP 2 x EP 8 = 16 does not divide 8 ranks
    assert (1, 1) not in pairs  # ETP 1 with EP 1 would replicate every expert over TP
    for ep, etp in pairs:
        assert 8 % ((etp or 2) * ep) == 0 and 8 % ep == 0


def test_moe_layouts_pin_ep_and_force_sequence_parallelism() -> None:
    sp = Space(load_model("mixtral-8x7b"), H100, 16, 64, 4096, Pins(tp=2, pp=2, ep=4, vpp=1, mb=1))
    lays, _ = layouts(sp)
    assert lays and {lay.ep for lay in lays} == {4} and all(lay.sp for lay in lays)
    assert "EP4" in lays[0].label()


def test_a_pinned_ep_the_rules_refuse_is_named() -> None:
    sp = Space(load_model("mixtral-8x7b"), H100, 16, 64, 4096, Pins(tp=2, pp=2, ep=16, vpp=1, mb=1))
    lays, rejected = layouts(sp)
    assert not lays
    assert any("--ep 16" in r.reason and "8 experts" in r.reason for r in rejected)


@pytest.mark.parametrize("budget_gib", [2.5, 0.25])
def test_bounds_hold_and_pruning_loses_nothing_on_a_stack(budget_gib: float) -> None:
    """A model of two layer kinds (dense first layers under MoE ones, `test_moe_stack.TINY_MOE`), searched over EP:
    every planned candidate's time is at least its bound (the cheapest kind's layer time; a stock split's real
    kinds), and the pruned search returns the exhaustive one's rows. 0.25 GiB: some layouts fit only with
    recomputation, some not at all (slow: Lynx-HEU on tight stacks, minutes)."""
    import math

    from lynx.models import model_from_dict
    from lynx.problem import PlanOptions
    from lynx.search import search
    from lynx.spec import GiB
    from tests.unit.test_moe_stack import TINY_MOE

    space = Space(model_from_dict(TINY_MOE), H100, 4, 16, 1024, Pins(pp=2, vpp=1, methods=("lynx", "none", "full")))
    opts = PlanOptions(budget_bytes=budget_gib * GiB)
    full = search(space, opts, top=3, exhaustive=True)
    planned = [o for o in full.outcomes if not math.isnan(o.iteration_s)]
    assert planned and {o.candidate.layout.ep for o in planned} >= {1, 2}
    assert any(o.fits for o in planned) and (budget_gib > 1 or full.count("does not fit"))
    for o in planned:
        assert o.bound_s <= o.iteration_s, (o.candidate, o.bound_s, o.iteration_s)
    pruned = search(space, opts, top=3)
    key = [(o.candidate, o.status, round(o.iteration_s, 12)) for o in full.ranked[:3]]
    assert [(o.candidate, o.status, round(o.iteration_s, 12)) for o in pruned.ranked[:3]] == key
