"""A finalist's price on the framework the search ranks for (`targets.rank_for_target`), one at a time or spread over
the search's processes (`parallel.Ahead.price`): `lynx.export.targets.target_price` of its plan."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from lynx.errors import LynxError
from lynx.problem import PlanProblem, PlanResult
from lynx.request import Target
from lynx.search.evaluate import Outcome

if TYPE_CHECKING:
    from lynx.export.targets import TargetPrice


Priced = tuple["TargetPrice | None", str]
"""A plan's price on a target (None: the target cannot run it) and, where it cannot, why."""
Pricer = Callable[[Sequence[Outcome], Target], list[Priced]]
"""Prices several planned outcomes on a target, in order (`price_plan` of each; `parallel.Ahead.price` spreads them
over the search's processes)."""


def price_plan(problem: PlanProblem, result: PlanResult, target: Target, stock: bool) -> Priced:
    """`lynx.export.targets.target_price` of a plan, with the reason where the target cannot run it."""
    from lynx.export.targets import target_price

    try:
        tp = target_price(problem, result, target, stock)
    except LynxError as e:
        return None, str(e).splitlines()[0]
    return tp, "" if tp is not None else \
        f"{target.value} cannot run it (no block for the {problem.model.family!r} family or layout)"


def price_outcome(o: Outcome, target: Target) -> Priced:
    """`price_plan` of a planned outcome's plan."""
    assert o.plan is not None
    return price_plan(o.plan.problem, o.plan.result, target, o.candidate.stock)


def price_in_turn(outcomes: Sequence[Outcome], target: Target) -> list[Priced]:
    """The `Pricer` of one process: each outcome's `price_outcome` in turn."""
    return [price_outcome(o, target) for o in outcomes]
