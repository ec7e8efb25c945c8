"""A finalist's price on the framework the search ranks for (`targets.rank_for_target`), one at a time or spread over
the search's processes (`parallel.Ahead.price`): `lynx.export.targets.target_price` of its plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from lynx.errors import LynxError
from lynx.plan import Plan
from lynx.problem import PlanProblem, PlanResult
from lynx.request import Target
from lynx.search.evaluate import LYNX_SEARCHED, Outcome

if TYPE_CHECKING:
    from lynx.export.targets import TargetPrice


Priced = tuple["TargetPrice | None", str]
"""A plan's price on a target (None: the target cannot run it) and, where it cannot, why."""


class Pricer(Protocol):
    """Prices several planned outcomes on a target, in order (`price_plan` of each; `parallel.Ahead.price` spreads
    them over the search's processes). `variants`: lynx's plans may be made again as the target runs them
    (`engine_variant`); off where the user gave --tp-comm-overlap, a flag that holds for every candidate."""

    def __call__(self, outcomes: Sequence[Outcome], target: Target, variants: bool = True) -> list[Priced]: ...


ENGINE_WITHOUT_UB = "Megatron-Core + lynx engine, no --tp-comm-overlap"
"""What a row priced on its `engine_variant` needs."""
RUNTIME_WITHOUT_UB = "lynx runtime, no --tp-comm-overlap"
"""What a row priced on its `runtime_variant` needs."""


def _price(problem: PlanProblem, result: PlanResult, target: Target, stock: bool) -> Priced:
    from lynx.export.targets import target_price

    try:
        tp = target_price(problem, result, target, stock)
    except LynxError as e:
        return None, str(e).splitlines()[0]
    return tp, "" if tp is not None else \
        f"{target.value} cannot run it (no block for the {problem.model.family!r} family or layout)"


def price_plan(problem: PlanProblem, result: PlanResult, target: Target, stock: bool, variants: bool = True) -> Priced:
    """`lynx.export.targets.target_price` of a plan, with the reason where the target cannot run it. With `variants`,
    a lynx plan priced with --tp-comm-overlap (TransformerEngine's userbuffers) is made again without it where the
    target's lynx cannot run them: on Megatron-Core, as lynx's engine runs it (`engine_variant`), the faster of the
    two that fits being its price; on lynx's own runtime, always (`runtime_variant`). The variant's
    `TargetPrice.plan` then names the plan (decision 0274)."""
    if stock or not variants or not _uses_userbuffers(problem, result) or target is Target.TORCHTITAN:
        return _price(problem, result, target, stock)
    if target is Target.LYNX:  # the plan as searched is never what lynx's runtime runs: not priced
        made = runtime_variant(problem, result)
        if made is None:
            return None, ("lynx's runtime has no TransformerEngine userbuffers, and planned without --tp-comm-overlap "
                          "no policy fits")
        alt = _price(made.problem, made.result, target, False)
        return (None, alt[1]) if alt[0] is None else (replace(alt[0], runs_on=RUNTIME_WITHOUT_UB, plan=made), "")
    priced = _price(problem, result, target, stock)
    variant = engine_variant(problem, result)
    if variant is None:
        return priced
    alt = _price(variant.problem, variant.result, target, False)
    if alt[0] is None or not _better(alt[0], priced[0]):
        return priced
    return replace(alt[0], runs_on=ENGINE_WITHOUT_UB, plan=variant), ""


def _better(a: TargetPrice, b: TargetPrice | None) -> bool:
    """`a` fits where `b` does not, or both fit (or neither) and `a` is faster."""
    if b is None:
        return True
    fa, fb = (all(st.fits for st in t.figures.stages) for t in (a, b))
    return fa > fb or (fa == fb and a.figures.iteration_time_s < b.figures.iteration_time_s)


def _uses_userbuffers(problem: PlanProblem, result: PlanResult) -> bool:
    """A lynx plan (not a stock method's) priced with --tp-comm-overlap on sequence-parallel TP."""
    opts, par = problem.options, problem.parallel
    return result.method in LYNX_SEARCHED and opts.tp_comm_overlap and par.sequence_parallel and par.tp > 1


def _remade(problem: PlanProblem, result: PlanResult) -> Plan | None:
    """The same layout and method planned without --tp-comm-overlap: its own layer graph (the sequence-parallel
    collectives exposed, the windows lynx hides recomputation in), Lynx-HEU and the partition search afresh; None
    where no policy fits then."""
    from lynx.api import make_problem
    from lynx.methods.heu import lynx_search

    try:
        again = make_problem(problem.model, problem.hardware, problem.parallel,
                             replace(problem.options, tp_comm_overlap=False))
        made = lynx_search(again, result.method, None, True, explain=False)[0]
        return Plan.evaluate(again, made, record=False)
    except (LynxError, ValueError):  # no policy fits without the overlap (HEU's builder raises ValueError too)
        return None


def engine_variant(problem: PlanProblem, result: PlanResult) -> Plan | None:
    """A lynx plan priced with Megatron's --tp-comm-overlap, made again as lynx's engine inside Megatron-Core runs
    it: the engine builds the model from Megatron-Core's local layer spec, which has no TransformerEngine
    userbuffers (`export.megatron_engine.engine_fit`), so with that flag the plan runs only by lynx's plugin, its
    windows lost. The same layout and method planned without the flag (`_remade`), where the engine runs everything
    else of it; None where it does not, or the plan is not lynx's (decision 0274)."""
    from lynx.export.megatron_engine import engine_fit

    if not _uses_userbuffers(problem, result):
        return None
    plain = replace(problem.options, tp_comm_overlap=False)
    if not engine_fit(replace(problem, options=plain), result).runs:  # reads the model, layout and options only
        return None
    return _remade(problem, result)


def runtime_variant(problem: PlanProblem, result: PlanResult) -> Plan | None:
    """A lynx plan priced with --tp-comm-overlap, made again as lynx's own runtime (`lynx train`) runs it: its
    tensor-parallel layers issue each collective whole (asynchronously, for the windows), never pipelined with the
    GEMM as TransformerEngine's userbuffers are (`_remade`); None where the plan does not use them or nothing fits."""
    return _remade(problem, result) if _uses_userbuffers(problem, result) else None


def price_outcome(o: Outcome, target: Target, variants: bool = True) -> Priced:
    """`price_plan` of a planned outcome's plan."""
    assert o.plan is not None
    return price_plan(o.plan.problem, o.plan.result, target, o.candidate.stock, variants)


def price_in_turn(outcomes: Sequence[Outcome], target: Target, variants: bool = True) -> list[Priced]:
    """The `Pricer` of one process: each outcome's `price_outcome` in turn."""
    return [price_outcome(o, target, variants) for o in outcomes]
