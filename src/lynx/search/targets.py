"""The search ranked for the framework the pick will run on (`lynx plan --gpus ... --target`).

The branch and bound plans every candidate with lynx's simulator (its bounds are bounds on any simulated plan
of a layout). For the megatron and torchtitan targets, the finalists -- in lynx's order at least the `2 x top`
fastest, until `top` fit on the target (at most `8 x top`), and the fastest stock Megatron-Core candidate -- are
then priced as `lynx export <target>` prices their plan
(`lynx.export.targets.target_price`: Megatron-Core's flags and plugin, torchtitan's kernels and FSDP) and ranked
by that price; their figures become the target's, so the pick's iteration time is, to the digit, the one
`lynx export <target>` shows for the plan `--out` writes. A finalist the target cannot run, or that does not fit
its memory there, is listed with the reason. The rest keep lynx's price (`priced_for` says which).

Re-pricing every planned candidate would multiply the search's time (an export pricing simulates each stage's
Megatron settings, tens of simulations): the finalists are where the target's price can change the pick, as a
framework runs a plan at most as fast as lynx's own runtime runs the same layout's best plan (it cannot hide
recomputation), docs/decisions/0120-request-and-target.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from lynx.errors import SpecError
from lynx.request import Target
from lynx.search.evaluate import Outcome
from lynx.search.prices import Priced, Pricer, price_in_turn
from lynx.search.run import SearchResult
from lynx.spec import GiB


def _repriced(o: Outcome, target: Target, priced: Priced) -> Outcome:
    assert o.plan is not None
    tp, why = priced
    if tp is None:
        return replace(o, status="invalid", reason=f"not priced for {target.value}: {why}", priced_for=target.value)
    f = tp.figures
    par = o.plan.problem.parallel
    peaks = tuple(s.peak_bytes / GiB for s in f.stages)
    over = [str(s.stage) for s in f.stages if not s.fits]
    tokens = f.samples_per_s * par.seq_length / par.world_size
    scale = o.iteration_s / f.iteration_time_s  # same work per iteration: throughput and MFU scale with time
    out = replace(o, status="planned" if not over else "does not fit",
                  reason=f"stage(s) {','.join(over)} over budget on {target.value}" if over else o.reason,
                  iteration_s=f.iteration_time_s, tokens_per_s_per_gpu=tokens, tflops_per_gpu=o.tflops_per_gpu * scale,
                  mfu=o.mfu * scale, stage_peak_gib=peaks, priced_for=target.value, runs_on=tp.runs_on)
    if tp.plan is not None:  # the plan made again as the target runs it (`prices.engine_variant`): `--out` writes it
        out = replace(out, plan=tp.plan, partition=tp.plan.result.partition.layers_per_stage,
                      budget_gib=tp.plan.problem.budget_bytes / GiB)
    return out


def rank_for_target(res: SearchResult, target: Target, top: int, pricer: Pricer = price_in_turn,
                    variants: bool = True) -> SearchResult:
    """The search's outcomes with its finalists priced and ranked for `target`: in lynx's order, at least the `2 x top`
    fastest and until `top` fit on the target (at most `8 x top`), the fastest stock candidate, and the published
    recipes' rows; the rest keep lynx's price and say so. `pricer` prices the ones this order needs, the first `2 x
    top`, the stock candidate that follows them and the published recipes at once (where more are needed, two at a
    time); an outcome priced and not needed is not used: the same answer in any number of processes. `variants`: a
    lynx plan priced with --tp-comm-overlap may be made again without it, as lynx's engine in Megatron-Core or lynx's
    own runtime runs it (`prices.price_plan`; off where the user gave the flag)."""
    ranked = res.ranked
    prices: dict[int, Priced] = {}
    # every candidate lynx prices under its `rows`-th fastest was planned (the tree pruned only bounds above it)
    planned_below = math.nan if res.rows <= 0 else ranked[res.rows - 1].iteration_s if res.rows <= len(ranked) \
        else math.inf

    def price(o: Outcome, ahead: Sequence[Outcome]) -> Outcome:
        """`o` on the target, the outcomes `ahead` (needed soon) priced beside it where they are not yet."""
        if id(o) not in prices:
            batch = [o, *(x for x in ahead if x is not o and id(x) not in prices)]
            for x, p in zip(batch, pricer(batch, target, variants), strict=True):
                prices[id(x)] = p
        return _repriced(o, target, prices[id(o)])

    # every target, lynx's own runtime too (a lynx plan priced with userbuffers is made again for it)
    new: dict[int, Outcome] = {}
    fitting = 0
    stock_after = next((o for o in ranked[2 * top:] if o.candidate.stock), None)
    recipes_planned = [] if target is Target.LYNX else \
        [o for _, o in res.recipes if o is not None and o.plan is not None]
    opening = [*ranked[:2 * top], *([stock_after] if stock_after is not None else []), *recipes_planned]
    unpriced = math.inf  # lynx's price of the fastest candidate of lynx's order left unpriced
    for i, o in enumerate(ranked):
        if (fitting >= top and len(new) >= 2 * top) or len(new) >= 8 * top:
            unpriced = o.iteration_s
            break
        new[id(o)] = price(o, opening if i == 0 else ranked[i + 1:i + 2])
        fitting += new[id(o)].fits
    if new and not fitting:  # nothing the target runs: say why rather than rank lynx's prices
        first = next(iter(new.values()))
        raise SpecError(f"--target {target.value}: none of the {len(new)} fastest configurations runs and fits "
                        f"there ({first.candidate.layout.label()} {first.candidate.method}: {first.reason}); "
                        "use another --target")
    stock = next((o for o in ranked if o.candidate.stock and id(o) not in new), None)
    if stock is not None and not any(o.candidate.stock and o.fits for o in new.values()):
        new[id(stock)] = price(stock, ())
    rest_note = f"lynx's price (not priced for {target.value})"
    outs = [new.get(id(o), o if target is Target.LYNX or not o.fits else replace(o, runs_on=rest_note))
            for o in res.outcomes]
    ids = {id(n) for n in new.values()}
    priced = [o for o in outs if id(o) in ids]
    rest = [o for o in outs if id(o) not in ids]
    priced.sort(key=lambda o: (not o.fits, o.iteration_s if o.fits else math.inf))
    recipes = res.recipes
    if target is not Target.LYNX:  # the published rows on the target too (the opening batch priced them): the
        # explanation compares with them
        recipes = tuple((a, o if o is None or o.plan is None else price(o, ())) for a, o in recipes)
    return replace(res, outcomes=tuple(priced + rest), recipes=recipes,
                   priced_floor_s=min(planned_below, unpriced))
