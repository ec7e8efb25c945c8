"""The configuration search: the space follows Megatron's rules, the bounds are lower bounds of what the
planner finds, and pruning by them returns exactly what exhaustive search returns."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from lynx.models import load_model
from lynx.problem import PlanOptions
from lynx.search import Pins, Space, search
from lynx.search.space import STOCK_METHODS, candidates, layout_candidates, layouts
from lynx.spec import GiB, ModelSpec, load_hardware

# Small spaces (4-8 GPUs, short sequences) that enumerate in seconds, over three model shapes: GPT with
# standard attention, LLaMA with grouped-query attention, and a budget tight enough that some layouts
# need recomputation and some do not fit at all.
SPACES = [
    pytest.param("gpt-tiny", "a100-40g-nvlink", 4, 32, 512, Pins(), 0.05, id="gpt-tiny-tight"),
    pytest.param("gpt-1.3b", "a100-40g-nvlink", 4, 16, 1024,
                 Pins(vpp=1, methods=("lynx", "none", "full", "selective")), None, id="gpt-1.3b",
                 marks=pytest.mark.slow),
    pytest.param("llama2-7b", "h100-80g-nvlink", 8, 16, 2048, Pins(tp=2, vpp=1, methods=("lynx", "full", "mc-mlp")),
                 None, id="llama2-7b-gqa", marks=pytest.mark.slow),
    # Context parallelism searched (16k tokens: CP 1 and 2) and pinned, under a budget where some layouts
    # need recomputation and some do not fit.
    pytest.param("llama-tiny", "h100-80g-nvlink", 4, 8, 16384, Pins(vpp=1, methods=("lynx", "none", "full", "mc-mlp")),
                 0.6, id="llama-tiny-cp-searched"),
    pytest.param("llama-tiny", "h100-80g-nvlink", 4, 8, 16384,
                 Pins(cp=2, methods=("lynx", "none", "full", "mc-mlp")), 0.35, id="llama-tiny-cp2"),
]


def _space(name: str, hw: str, gpus: int, gb: int, seq: int, pins: Pins) -> Space:
    return Space(load_model(name), load_hardware(hw), gpus, gb, seq, pins)


def _key(o):  # noqa: ANN001, ANN202 (an Outcome)
    return (o.candidate, o.status, None if math.isnan(o.iteration_s) else round(o.iteration_s, 12))


@pytest.mark.parametrize(("model", "hw", "gpus", "gb", "seq", "pins", "budget"), SPACES)
def test_pruned_search_equals_exhaustive(model: str, hw: str, gpus: int, gb: int, seq: int, pins: Pins,
                                         budget: float | None) -> None:
    space = _space(model, hw, gpus, gb, seq, pins)
    opts = PlanOptions(budget_bytes=None if budget is None else budget * GiB)
    top = 3
    pruned = search(space, opts, top=top)
    full = search(space, opts, top=top, exhaustive=True)
    assert full.pruned == full.over_memory_bound  # exhaustive plans everything the memory bounds keep
    # The table's rows and the stock-Megatron row are the same, with the same figures, once the candidates the
    # pruned search left unplanned as dominated are taken out (each is no faster than a row of its own layout).
    dominated = _dominated_no_faster(pruned, full)
    assert [_key(o) for o in pruned.ranked[:top]] == [_key(o) for o in full.ranked
                                                      if o.candidate not in dominated][:top]
    assert (pruned.best_stock and _key(pruned.best_stock)) == (full.best_stock and _key(full.best_stock))
    assert pruned.considered == full.considered


def _dominated_no_faster(pruned, full):  # noqa: ANN001, ANN202 (SearchResults)
    """The candidates `pruned` records as dominated; each, where the exhaustive search planned it, is no faster
    than the fastest fitting candidate of the same layout and split."""
    dominated = {o.candidate for o in pruned.outcomes if o.status == "dominated"}
    for o in full.outcomes:
        if o.candidate in dominated and o.fits:
            same = [x.iteration_s for x in full.outcomes if x.fits and x.candidate != o.candidate
                    and (x.candidate.layout, x.candidate.split) == (o.candidate.layout, o.candidate.split)]
            assert same and min(same) <= o.iteration_s, (o.candidate, o.iteration_s, same)
    return dominated


@pytest.mark.parametrize(("model", "hw", "gpus", "gb", "seq", "pins", "budget"), SPACES)
def test_bounds_hold_for_every_planned_candidate(model: str, hw: str, gpus: int, gb: int, seq: int, pins: Pins,
                                                 budget: float | None) -> None:
    space = _space(model, hw, gpus, gb, seq, pins)
    opts = PlanOptions(budget_bytes=None if budget is None else budget * GiB)
    full = search(space, opts, exhaustive=True)
    planned = [o for o in full.outcomes if not math.isnan(o.iteration_s)]
    assert planned, "the space must plan something for the check to mean anything"
    for o in planned:
        assert o.bound_s <= o.iteration_s, (o.candidate, o.bound_s, o.iteration_s)


def test_memory_bound_never_refuses_a_layout_that_fits() -> None:
    """Plan the candidates the memory bound refuses anyway: none of them fits."""
    from lynx.search.evaluate import Shared, plan_candidate

    space = _space("gpt-tiny", "a100-40g-nvlink", 4, 32, 512, Pins())
    opts = PlanOptions(budget_bytes=0.05 * GiB)
    res = search(space, opts, exhaustive=True)
    refused = [o.candidate for o in res.outcomes if o.status == "over budget (bound)"]
    assert refused
    # the stock methods' own layer policies refuse some the layer inputs alone would not (`partition_memory_reason`)
    assert any("keeps of each layer" in o.reason for o in res.outcomes if o.status == "over budget (bound)")
    whole = _refused_candidates(res)  # layouts refused on static memory alone: every candidate of theirs
    assert whole and len(whole) == res.refused_count
    shared = Shared(space, opts)
    for c in refused + whole:
        assert not plan_candidate(shared, c, math.nan).fits, c


def _refused_candidates(res):  # noqa: ANN001, ANN202 (a SearchResult)
    """Every candidate of the layouts the search refused whole on their static memory."""
    out = []
    for core, _ in res.refused:
        for v in core.vpps:
            own, stock = layout_candidates(res.space, core.at(v))
            out += own + stock
    return out


def test_space_follows_megatron_rules() -> None:
    m, hw = load_model("llama3-70b"), load_hardware("h100-80g-nvlink")  # 64 heads, 8 query groups, 80 layers
    lays, rejected = layouts(Space(m, hw, 64, 512, 8192))
    assert {lay.tp for lay in lays} == {1, 2, 4, 8}
    assert any("query groups" in r.reason for r in rejected)  # TP 16 would split the 8 K/V heads
    gpt, _ = layouts(Space(load_model("gpt-175b"), hw, 64, 64, 2048, Pins(pp=8, mb=1, sp=False, dist_opt=False)))
    assert {lay.tp for lay in gpt} == {1, 2, 4, 8}  # 96 heads split 16 ways, but TP 16 crosses a node
    wide, _ = layouts(Space(load_model("gpt-175b"), hw, 128, 64, 2048, Pins(pp=8, mb=1, sp=False, dist_opt=False),
                            allow_cross_node_tp=True))
    assert 16 in {lay.tp for lay in wide}
    assert {lay.cp for lay in lays} >= {1, 2, 4, 8}  # CP at every sequence length (8k tokens too)
    assert {lay.cp_comm_type for lay in lays if lay.cp > 1} == {"p2p", "all_gather", "a2a"}
    for lay in lays:
        assert lay.tp * lay.cp * lay.pp * lay.dp == 64 and 512 % (lay.dp * lay.mb) == 0
        assert lay.dp * lay.cp > 1 or not lay.dist_opt
        assert lay.tp > 1 or not lay.sp
        if lay.vpp > 1:  # every VPP Megatron runs with a layout: a layer per virtual stage
            assert lay.pp >= 2 and (512 // (lay.dp * lay.mb)) % lay.pp == 0 and lay.pp * lay.vpp <= 80
    assert max(lay.vpp for lay in lays if lay.pp == 4) == 20  # beyond the old cap of 4


def test_pins_fix_their_dimension_and_stock_runs_megatrons_splits() -> None:
    from lynx.search.splits import chunks

    m, hw = load_model("gpt-1.3b"), load_hardware("a100-40g-nvlink")  # 24 layers
    cands, _ = candidates(Space(m, hw, 8, 64, 1024, Pins(tp=2, mb=1, sp=True, dist_opt=False)))
    assert cands and all(c.layout.tp == 2 and c.layout.mb == 1 and c.layout.sp and not c.layout.dist_opt
                         for c in cands)
    assert {c.method for c in cands} == {"lynx", *STOCK_METHODS}
    for c in cands:
        assert c.stock == (c.method in STOCK_METHODS)
        if c.stock:  # a split Megatron-Core builds: whole layers per virtual stage, none empty
            assert chunks(c.split, 24, c.layout.pp, c.layout.vpp) is not None
    assert any(c.stock and not c.split.even for c in cands)  # uneven first/last stages are stock too
    full, _ = candidates(Space(m, hw, 8, 64, 1024, Pins(methods=("full",), vpp=1)))
    assert {c.method for c in full} == {"full"}


def test_megatron_splits_give_the_published_uneven_layouts() -> None:
    """126-layer Llama-3.1-405B has stock candidates: Meta's 7 + 14 x 8 + 7 over PP 16 (Megatron's
    --account-for-embedding/loss-in-pipeline-split gives the same split) and NVIDIA's PP 8 x VPP 8 with both
    account-for flags (2 layers per virtual stage, 1 on the first and the last)."""
    from lynx.search.splits import Split, chunks, stock_splits

    meta = {chunks(s, 126, 16, 1) for s in stock_splits(126, 16, 1)}
    assert (7, *[8] * 14, 7) in meta
    assert chunks(Split(first=7, last=7), 126, 16, 1) == (7, *[8] * 14, 7)
    nvidia = chunks(Split(embedding=True, loss=True), 126, 8, 8)
    assert nvidia is not None and nvidia[0] == 1 and nvidia[-1] == 1 and set(nvidia[1:-1]) == {2}
    assert Split(embedding=True, loss=True) in stock_splits(126, 8, 8)
    assert chunks(Split(), 126, 8, 1) is None  # 126 does not divide by 8: Megatron refuses the even split
    assert chunks(Split(first=7, embedding=True), 126, 16, 1) is None  # Megatron asserts the two exclude
    assert chunks(Split(first=6), 126, 8, 8) is None  # the first stage's layers must divide by VPP


def test_search_prefers_fitting_and_reports_counts() -> None:
    space = _space("gpt-1.3b", "a100-40g-nvlink", 4, 16, 1024, Pins(vpp=1, methods=("lynx", "none")))
    res = search(space, PlanOptions())
    assert res.best is not None and res.best.fits
    assert max(res.best.stage_peak_gib) <= res.best.budget_gib
    assert res.considered == res.planned + res.pruned + res.count("invalid")
    assert [o.iteration_s for o in res.ranked] == sorted(o.iteration_s for o in res.ranked)


def test_context_parallel_layouts_follow_megatron_rules() -> None:
    """CP is searched at every sequence length (every size dividing the cluster, each comm type the heads allow),
    pinned with --cp / --cp-comm-type, and refused with Megatron-Core's reason (flash attention, sequence divisible
    by 2 x CP)."""
    hw = load_hardware("h100-80g-nvlink")
    m = load_model("llama3-70b")
    lays, _ = layouts(Space(m, hw, 64, 64, 8192, Pins(tp=8, vpp=1, mb=1, sp=True, dist_opt=True)))
    assert {lay.cp for lay in lays} == {1, 2, 4, 8}
    for lay in lays:
        assert lay.tp * lay.cp * lay.pp * lay.dp == 64 and 8192 % (2 * lay.cp) == 0
    # the all-to-all needs whole K/V heads per CP rank: 8 query groups / TP 8 leave one, so no a2a at TP 8
    assert {lay.cp_comm_type for lay in lays if lay.cp > 1} == {"p2p", "all_gather"}
    pinned, _ = layouts(Space(m, hw, 64, 512, 8192, Pins(cp=2, tp=4), cp_comm_type="p2p"))
    assert pinned and {(lay.cp, lay.cp_comm_type) for lay in pinned} == {(2, "p2p")}
    assert all(lay.tp * 2 * lay.pp * lay.dp == 64 for lay in pinned)
    assert all("CP2" in lay.label() for lay in pinned)
    odd, rejected = layouts(Space(m, hw, 64, 512, 8190, Pins(cp=2, tp=4)))  # 8190 % 4 != 0
    assert not odd and any("2 x CP" in r.reason for r in rejected)
    gpt, rejected = layouts(Space(load_model("gpt-1.3b"), hw, 8, 64, 2048, Pins(cp=2)))  # standard attention
    assert not gpt and any("flash" in r.reason for r in rejected)


def test_a_context_parallel_candidate_is_planned_as_lynx_plan_plans_it() -> None:
    """The search hands CP (and its comm type) to the planner: a stock candidate's figures equal `lynx plan`'s
    for the same layout, to the last bit."""
    from lynx.api import make_problem, plan
    from lynx.spec import ParallelSpec

    m, hw = load_model("llama-tiny"), load_hardware("h100-80g-nvlink")
    space = Space(m, hw, 4, 8, 16384, Pins(cp=2, tp=1, pp=2, vpp=1, mb=1, sp=False, dist_opt=False,
                                           methods=("full",)), cp_comm_type="a2a")
    res = search(space, PlanOptions(), exhaustive=True)
    o = next(o for o in res.outcomes if o.candidate.split.even)  # Megatron's other splits are candidates too
    assert o.fits and o.candidate.layout.cp == 2 and o.candidate.layout.dp == 1
    par = ParallelSpec(tp=1, pp=2, dp=1, cp=2, cp_comm_type="a2a", micro_batch_size=1, global_batch_size=8,
                       seq_length=16384)
    nodes = -(-4 // hw.devices_per_node)  # the production overlaps this layout allows: the gradient reduction's
    direct = plan(make_problem(m, hw, par, PlanOptions(nodes=nodes, overlap_grad_reduce=True)), "full", record=False)
    assert o.iteration_s == direct.sim.iteration_time_s
    assert o.stage_peak_gib == tuple(st.peak_memory_bytes / GiB for st in direct.sim.stages)


def test_exact_partition_with_a_lower_bound_makes_the_same_moves() -> None:
    """The bound only spares evaluations: on random stage costs with ties and infeasible stages, the exact
    min-max search returns the same split with and without it, and evaluates no more."""
    import random

    from lynx.partition.lynx import CostTable, exact_partition

    rng = random.Random(19)
    for _ in range(300):
        p, layers = rng.randint(2, 6), rng.randint(6, 30)
        table = {(s, n): (math.inf if rng.random() < 0.05 else rng.choice([1.0, 2.0, 2.0, 3.0]) * n
                          + rng.choice([0.0, 0.5, 0.5])) for s in range(p) for n in range(1, layers + 2)}
        slack = {k: rng.choice([0.0, 0.0, 0.25, 1.0]) for k in table}

        def cost(s: int, n: int, table: dict[tuple[int, int], float] = table) -> float:
            return table[(s, n)]

        def lower(s: int, n: int, table: dict[tuple[int, int], float] = table,
                  slack: dict[tuple[int, int], float] = slack) -> float:
            return table[(s, n)] - slack[(s, n)]

        start = [1] * p
        for _ in range(layers - p):
            start[rng.randrange(p)] += 1
        plain, bounded = CostTable(cost), CostTable(cost)
        assert exact_partition(tuple(start), plain) == exact_partition(tuple(start), bounded, lower)
        assert len(bounded.values) <= len(plain.values)


def _model(spec: str) -> ModelSpec:
    """A preset by name; "name:L" deepens it to L layers, the first two dense and the rest MoE (a stack of kinds)."""
    name, _, layers = spec.partition(":")
    m = load_model(name)
    if layers:
        m = replace(m, num_layers=int(layers), moe_layer_pattern=(0, 0) + (1,) * (int(layers) - 2))
    return m


OFFLOAD_SPACES = [
    # every layout (VPP searched: interleaved stages offload per chunk) with lynx, lynx-offload, mc-offload and the
    # stock flags, under budgets where keeping everything does not fit and offloading has something to win
    pytest.param("gpt-tiny", "a100-40g-nvlink", 4, 32, 512, 0.05, id="gpt-tiny-tight"),
    pytest.param("llama-tiny", "h100-80g-nvlink", 4, 8, 16384, 0.6, id="llama-tiny-16k"),
    # a stack of two layer kinds (DeepSeek-V3's toy layers, 2 dense under 6 MoE; decision 0258)
    pytest.param("deepseek-v3-tiny:8", "a100-40g-nvlink", 4, 16, 64, 0.006, id="deepseek-tiny-stack",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("model", "hw", "gpus", "gb", "seq", "budget"), OFFLOAD_SPACES)
def test_pruned_search_equals_exhaustive_with_offloading(model: str, hw: str, gpus: int, gb: int, seq: int,
                                                         budget: float) -> None:
    """With the offloading methods in the space (`lynx plan --gpus --offload`) the memory bound still refuses only
    what cannot fit (it counts the layer inputs, which no method offloads), the time bound stays below every
    planned iteration (copies only add time), and pruning returns exactly the exhaustive table."""
    from lynx.search.evaluate import Shared, plan_candidate

    space = Space(_model(model), load_hardware(hw), gpus, gb, seq, Pins(), offload=True)
    opts = PlanOptions(budget_bytes=budget * GiB)
    top = 3
    pruned = search(space, opts, top=top)
    full = search(space, opts, top=top, exhaustive=True)
    dominated = _dominated_no_faster(pruned, full)  # rows of their own layout that a cheaper method beats
    assert [_key(o) for o in pruned.ranked[:top]] == [_key(o) for o in full.ranked
                                                      if o.candidate not in dominated][:top]
    assert (pruned.best_stock and _key(pruned.best_stock)) == (full.best_stock and _key(full.best_stock))
    assert pruned.considered == full.considered
    methods = {o.candidate.method for o in full.outcomes}
    assert {"lynx-offload", "mc-offload"} <= methods
    # some lynx-offload plan offloads, interleaved ones included where the space has them (not a stack of kinds:
    # HEU's runs' models have no offloading, `policy.heu._build_runs`)
    offloading = [o for o in full.outcomes if o.plan is not None and o.candidate.method == "lynx-offload"
                  and any(lp.offload for pol in o.plan.result.policies for lp in pol.layers)]
    assert offloading or ":" in model
    for o in full.outcomes:
        if not math.isnan(o.iteration_s):
            assert o.bound_s <= o.iteration_s, (o.candidate, o.bound_s, o.iteration_s)
    shared = Shared(space, opts)
    refused = [o.candidate for o in full.outcomes if o.status == "over budget (bound)"] + _refused_candidates(full)
    for c in refused:
        if c.method in ("lynx-offload", "mc-offload"):
            assert not plan_candidate(shared, c, math.nan).fits, c


@pytest.mark.parametrize(("model", "hw", "gpus", "gb", "seq", "pins", "budget"), SPACES[:1] + SPACES[3:4])
def test_policy_bound_holds_for_every_planned_stock_candidate(model: str, hw: str, gpus: int, gb: int, seq: int,
                                                              pins: Pins, budget: float | None) -> None:
    """The bound a stock candidate gets once its method has chosen its policies (block's N included), before it
    is simulated, never exceeds its simulated time."""
    from dataclasses import replace

    from lynx.search.evaluate import Shared
    from lynx.search.space import Core
    from lynx.search.tree import Frontier, Kind, Node

    space = _space(model, hw, gpus, gb, seq, pins)
    opts = PlanOptions(budget_bytes=None if budget is None else budget * GiB)
    full = search(space, opts, exhaustive=True)
    frontier = Frontier(Shared(space, opts))
    checked = set()
    for o in full.outcomes:
        c = o.candidate
        if not c.stock or c.recipe or o.plan is None or math.isnan(o.iteration_s):
            continue
        node = Node(Kind.STOCK, Core(replace(c.layout, vpp=1), (c.layout.vpp,)), c.layout, c.split)
        bound = frontier.policy_bound(node, o.plan.problem, o.plan.result)
        assert bound <= o.iteration_s, (c, bound, o.iteration_s)
        checked.add(c.method)
    assert {"block", "full"} <= checked or {"full", "mc-mlp"} <= checked, checked


def test_a_refined_finalist_is_not_pruned_by_its_screens_bound() -> None:
    """Mist's GPT-1.3B job on 2 L4 (standard attention, 16-byte state): the best plan is an interleaved lynx plan
    whose partition refinement beats the time of keeping everything on its dp split (the node's simulated bound),
    so that bound may prune it only once it cannot be a finalist. Pruned and exhaustive pick the same plan."""
    from dataclasses import replace

    m = load_model("mist-gpt-1.3b")
    model = replace(m, attention="standard", max_position_embeddings=max(m.max_position_embeddings, 2048))
    hw = load_hardware("l4-24g-pcie")
    space = Space(model, hw, 2, 32, 2048, Pins(), offload=hw.host() is not None)
    opts = PlanOptions(precision="paper", overlap_grad_reduce=True, check_for_nan_in_grad=False)
    pruned, full = search(space, opts, top=10), search(space, opts, top=10, exhaustive=True)
    assert pruned.best is not None and full.best is not None
    assert pruned.best.candidate.layout.vpp > 1  # the refined interleaved plan
    assert pruned.best.bound_s > pruned.best.iteration_s  # its screen's bound is above its refined time
    assert _key(pruned.best)[1:] == _key(full.best)[1:]


@pytest.mark.parametrize(("model", "hw", "gpus", "gb", "seq", "budget"), [
    pytest.param("gpt-tiny", "a100-40g-nvlink", 4, 32, 512, 0.05, id="gpt-tiny-tight"),
    pytest.param("llama-tiny", "h100-80g-nvlink", 4, 8, 16384, 0.6, id="llama-tiny-16k", marks=pytest.mark.slow),
])
def test_screen_bound_holds_for_every_interleaved_lynx_screen(model: str, hw: str, gpus: int, gb: int, seq: int,
                                                              budget: float) -> None:
    """The bound a lynx interleaved candidate gets from its stage models' LP floors (`Frontier.screen_bound`, the
    least on-demand recomputation HEU can choose on its dp split) never exceeds the screen it bounds, with and
    without offloading; it is above the plain bound somewhere (keeping everything does not fit there), and
    offloading's floor is never above lynx's (its models relax lynx's)."""
    from dataclasses import replace

    from lynx.methods.common import base_partition
    from lynx.search.bounds import plain_s
    from lynx.search.evaluate import LYNX_SEARCHED, Shared, plan_candidate
    from lynx.search.space import Core
    from lynx.search.tree import Frontier, Kind, Node

    space = Space(_model(model), load_hardware(hw), gpus, gb, seq, Pins(), offload=True)
    opts = PlanOptions(budget_bytes=budget * GiB)
    shared = Shared(space, opts)
    frontier = Frontier(shared)
    above_plain = 0
    checked: set[str] = set()
    screens: dict[tuple[object, str], float] = {}
    for c in candidates(space)[0]:
        if c.stock or c.method not in LYNX_SEARCHED or c.layout.vpp == 1:
            continue
        o = plan_candidate(shared, c, math.nan)  # the screen: HEU on the dp split, no refinement
        if not o.fits:
            continue
        node = Node(Kind.LYNX, Core(replace(c.layout, vpp=1), (c.layout.vpp,)), c.layout, tight=True, plain=True)
        bound = frontier.screen_bound(node, c.method)
        assert bound <= o.iteration_s, (c, bound, o.iteration_s)
        problem = shared.problem(c.layout, None)
        above_plain += bound > plain_s(problem, base_partition(problem))
        screens[(c.layout, c.method)] = bound
        checked.add(c.method)
    assert checked == set(LYNX_SEARCHED)
    assert above_plain, "no screen bound above the plain one: the check would not mean anything"
    for (lay, method), bound in screens.items():
        if method == "lynx" and (lay, "lynx-offload") in screens:
            assert screens[(lay, "lynx-offload")] <= bound * (1 + 1e-6), lay


def test_a_stack_of_layer_kinds_bounds_each_layer_by_its_own_kind() -> None:
    """On a stack of kinds (2 dense layers under 6 MoE ones) the time bounds count every layer's own plain step,
    not the cheapest kind's for all of them: the any-split bound is at least the micro-batches' work spread evenly
    over the ranks, and both it and the planned split's bound stay below the planned iteration time, 1F1B and
    interleaved (DeepSeek-V3's bounds were 0.34-0.85 of its plans with the cheapest kind's step,
    benchmarks/results/stack_bounds.json). A stock method's bound (`bounds.method_pieces`: Megatron's full
    recomputation on every layer, each of its kind) is above its split's and below the plan."""
    from lynx.search.bounds import method_pieces, partition_time_bound_s, pieces, time_bound_from
    from lynx.search.evaluate import Shared, plan_candidate

    space = Space(_model("deepseek-v3-tiny:8"), load_hardware("a100-40g-nvlink"), 4, 16, 64,
                  Pins(tp=1, mb=1, dist_opt=True, fsdp=False, methods=("lynx", "full")))
    opts = PlanOptions(budget_bytes=0.006 * GiB)
    shared = Shared(space, opts)
    seen: set[tuple[int, int, str]] = set()
    for c in candidates(space)[0]:
        o = plan_candidate(shared, c, math.nan)
        if not o.fits or o.plan is None:
            continue
        lay = c.layout
        problem = shared.problem(lay, None)
        p = pieces(problem)
        steps = [problem.kind_graph(k).step_time(problem.options.subtract_wgrad)
                 for k in problem.range_kinds(0, p.layers)]
        assert len(set(steps)) == 2 and p.total == pytest.approx(sum(steps), rel=1e-12)
        bound = time_bound_from(p, lay.vpp)
        assert p.nmb * sum(steps) / lay.pp * (1 - 1e-9) <= bound <= o.iteration_s, (c, bound, o.iteration_s)
        part = o.plan.result.partition
        chunks = part.chunks or part.layers_per_stage
        split = partition_time_bound_s(problem, chunks, p)
        assert split <= o.iteration_s, c
        if c.method == "full":
            longer = method_pieces(problem, "full", p)
            assert longer is not None and longer.total > p.total
            assert split < partition_time_bound_s(problem, chunks, longer) <= o.iteration_s, c
        seen.add((lay.pp, lay.vpp, c.method))
    assert {(2, 1), (2, 2)} <= {(pp, vpp) for pp, vpp, _ in seen} and {m for *_, m in seen} == {"lynx", "full"}
    assert method_pieces(problem, "block", p) is None  # its recomputation depends on a layer's place


def test_a_search_stopped_by_its_time_limit_says_how_far_its_pick_can_be(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--search-time-limit`: the tree stops deciding candidates, and the smallest bound of what it left is a lower
    bound on every candidate it did not decide, so the exhaustive optimum is either among its outcomes or no faster
    than that bound. The clock is the search's own, made to tick once per reading so that the stop falls mid-way."""
    import lynx.search.run as run_module
    from lynx.search.report import explain, result_dict

    space = _space("gpt-tiny", "a100-40g-nvlink", 4, 32, 512, Pins())
    opts = PlanOptions(budget_bytes=0.05 * GiB)
    full = search(space, opts, top=3, exhaustive=True)

    class Clock:
        ticks = 0.0

        @classmethod
        def perf_counter(cls) -> float:
            cls.ticks += 1.0
            return cls.ticks

    monkeypatch.setattr(run_module, "time", Clock)
    done = search(space, opts, top=3, time_limit_s=1e9)
    assert not done.stopped and done.unplanned == 0 and math.isnan(done.open_bound_s)
    readings = Clock.ticks  # the clock readings of a search the limit does not stop
    stops = []
    for limit in (0.5, readings / 4, readings / 2, readings * 3 / 4):
        Clock.ticks = 0.0
        res = search(space, opts, top=3, time_limit_s=limit)
        assert res.considered == full.considered
        if not res.stopped:
            continue
        stops.append(res)
        decided = {o.candidate for o in res.outcomes}
        left = [o for o in full.outcomes if o.fits and o.candidate not in decided]
        assert left and all(o.iteration_s >= res.open_bound_s for o in left)
        assert full.best is not None and (full.best.iteration_s >= res.open_bound_s
                                          or (res.best is not None and res.best.iteration_s <= full.best.iteration_s))
        text = " ".join(explain(res))
        assert "stopped at its time limit" in text and f"{res.unplanned:,} candidates not planned" in text
        d = result_dict(res)
        assert d["stopped_at_time_limit"] and d["not_planned"] == res.unplanned > 0
        assert (d["fastest_in_lynx_pricing_s"] is None) == (res.best is None)
    assert len(stops) >= 3 and stops[0].best is None and any(r.best is not None for r in stops)
