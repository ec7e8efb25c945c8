"""Decision 0278: how far a target's pick can be from the target's fastest. The ranking prices only lynx's fastest
candidates for the target; every other one takes at least `priced_floor_s` in lynx's pricing, and a target runs a
candidate no faster than lynx prices it. Checked on a space planned whole and priced whole."""

from __future__ import annotations

import math

import pytest

from lynx.models import load_model
from lynx.problem import PlanOptions
from lynx.request import Target
from lynx.search import Space, search
from lynx.search.report import explain, result_dict
from lynx.search.space import Stock
from lynx.search.targets import rank_for_target
from lynx.spec import load_hardware


def _key(o):  # noqa: ANN001, ANN202 (an Outcome)
    c = o.candidate
    return c.layout, c.method, c.split


@pytest.mark.parametrize(("target", "model"), [(Target.MEGATRON, "gpt-tiny"), (Target.MEGATRON, "llama-tiny"),
                                               (Target.LYNX, "gpt-tiny"), (Target.TORCHTITAN, "llama-tiny")])
def test_candidates_not_priced_for_the_target_are_no_faster_there_than_the_floor(target: Target, model: str) -> None:
    stock = Stock.TORCHTITAN if target is Target.TORCHTITAN else Stock.MEGATRON
    space = Space(load_model(model), load_hardware("h100-80g-nvlink"), 4, 16, 512, offload=True, stock=stock)
    res = search(space, PlanOptions(precision="megatron-bf16"), top=1, exhaustive=True, rows=2)
    small = rank_for_target(res, target, 1)  # the pick as the CLI makes it with --top 1: two rows priced
    whole = rank_for_target(res, target, len(res.ranked))  # every fitting candidate priced for the target
    lynx_price = {_key(o): o.iteration_s for o in res.ranked}
    on_target = {_key(o): o for o in whole.outcomes if o.priced_for == target.value}
    assert len(on_target) == len(res.ranked) > 2
    # the premise: a target runs a candidate no faster than lynx prices it
    assert all(o.iteration_s >= lynx_price[k] * (1 - 1e-12) for k, o in on_target.items())
    floor = small.priced_floor_s
    assert math.isfinite(floor)
    priced = {_key(o) for o in small.outcomes if o.runs_on and not o.runs_on.startswith("lynx's price")}
    unpriced = [o for k, o in on_target.items() if k not in priced and o.fits]
    assert unpriced and all(o.iteration_s >= floor * (1 - 1e-12) for o in unpriced)
    pick, best = small.best, whole.best
    assert pick is not None and best is not None
    within = result_dict(small)["pick_within"]
    assert within == pytest.approx(max(0.0, pick.iteration_s / floor - 1))
    assert pick.iteration_s <= best.iteration_s * (1 + within) * (1 + 1e-12)  # what the sentence promises
    said = [line for line in explain(small) if line.startswith("The pick is")]
    assert len(said) == 1 and f"{floor:.4g} s" in said[0] and target.value in said[0]
