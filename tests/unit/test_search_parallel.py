"""The search with worker processes (`lynx plan --gpus N --jobs J`, `lynx.search.parallel`): the workers search
the tree beside the search's process and the table is the one-process search's (its exact rows, the stock row, the
recipes); with the workers planning ahead instead (`run.SIDE_BY_SIDE` off) every outcome and count is. The workers
are really used, and none is left running when the search ends or is interrupted."""

from __future__ import annotations

import functools
import math
import multiprocessing

import pytest

from lynx.models import load_model
from lynx.problem import PlanOptions
from lynx.request import Target
from lynx.search import Pins, Space, parallel, run, search
from lynx.search.prices import ENGINE_WITHOUT_UB
from lynx.search.targets import rank_for_target
from lynx.spec import GiB, load_hardware


def _rows(res):  # noqa: ANN001, ANN202 (a SearchResult)
    return [(o.candidate, o.status, None if math.isnan(o.iteration_s) else o.iteration_s, o.stage_peak_gib,
             o.partition, o.reason) for o in res.outcomes]


def _table(res):  # noqa: ANN001, ANN202 (a SearchResult)
    """What any number of processes finds: the exact rows (every candidate that could be among them planned), the
    stock row, the recipes' rows, and how many candidates were considered."""
    stock = res.best_stock
    return ([(o.candidate, o.iteration_s, o.stage_peak_gib, o.partition, o.priced_for, o.runs_on)
             for o in res.ranked[:res.rows]],
            None if stock is None else (stock.candidate, stock.iteration_s),
            [(a.recipe.name, o and o.iteration_s) for a, o in res.recipes], res.considered)


@pytest.fixture
def workers_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start the workers with the search (a search this small ends before the default delay)."""
    monkeypatch.setattr(run, "AHEAD_AFTER_S", 0.0)


def _space() -> Space:
    return Space(load_model("gpt-tiny"), load_hardware("a100-40g-nvlink"), 4, 32, 512, Pins(), offload=True)


OPTS = PlanOptions(budget_bytes=0.05 * GiB)
"""A budget where some lynx candidates recompute, some offload and some do not fit."""


@functools.cache
def _one(rows: int = 3):  # noqa: ANN202 (a SearchResult)
    """The one-process search every test compares with (searched once per test run)."""
    return search(_space(), OPTS, top=3, rows=rows)


@pytest.mark.usefixtures("workers_at_once")
@pytest.mark.parametrize("rows", [3, 6])
def test_workers_search_the_tree_beside_and_give_the_same_table(rows: int) -> None:
    """Two workers search the cores no process has taken yet beside the search's own, with shared incumbents: the
    `rows` fastest, the stock row and the recipes are the one-process search's (the same when the exact rows are
    twice the table, as a target's ranking asks), every candidate is counted once, and the workers decided some."""
    one = _one(rows)
    two = search(_space(), OPTS, top=3, jobs=3, rows=rows)
    assert one.rows == two.rows == rows and len(one.ranked) >= rows
    assert _table(two) == _table(one)
    assert len({(o.candidate, o.candidate.split) for o in two.outcomes}) == len(two.outcomes)  # none twice
    assert two.jobs == 3 and two.beside > 0 and one.beside == 0
    from lynx.search.report import explain

    said = " ".join(explain(two))
    assert f"2 worker processes searched the tree beside this one and decided {two.beside:,}" in said
    assert f"the {rows} fastest rows, the stock row and the recipes are what --jobs 1 finds" in said
    assert any(o.plan is not None and o.candidate.layout.vpp > 1 for o in two.outcomes)
    assert not multiprocessing.active_children()


@pytest.mark.usefixtures("workers_at_once")
@pytest.mark.parametrize("take_back", [False, True], ids=["wait-for-every-worker", "take-back-queued"])
def test_workers_planning_ahead_give_the_same_search(take_back: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the workers planning lynx's candidates ahead of the tree (`run.SIDE_BY_SIDE` off): every outcome is the
    one-process search's, whether the tree waits for each candidate it handed out (then the workers plan most of
    lynx's candidates) or takes back the ones no worker has started."""
    monkeypatch.setattr(parallel, "TAKE_BACK", take_back)
    monkeypatch.setattr(run, "SIDE_BY_SIDE", False)
    one = _one()
    two = search(_space(), OPTS, top=3, jobs=3)
    assert _rows(two) == _rows(one)
    assert [(a.recipe.name, o and o.iteration_s) for a, o in two.recipes] == \
        [(a.recipe.name, o and o.iteration_s) for a, o in one.recipes]
    assert (two.considered, two.pruned, two.planned, two.simulated) == \
        (one.considered, one.pruned, one.planned, one.simulated)
    assert one.jobs == 1 and one.ahead == (0, 0)
    handed, used = two.ahead
    lynx_planned = sum(o.candidate.method in ("lynx", "lynx-offload") and o.status in ("planned", "does not fit")
                       for o in two.outcomes)
    assert two.jobs == 3 and used <= handed, two.ahead
    if not take_back:
        assert used >= lynx_planned // 2, (two.ahead, lynx_planned)
    assert any(o.plan is not None and o.candidate.layout.vpp > 1 for o in two.outcomes)
    assert not multiprocessing.active_children()


@pytest.mark.usefixtures("workers_at_once")
def test_finalists_priced_for_the_target_over_the_workers_rank_as_in_one_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`--target megatron`: the finalists' prices as Megatron-Core runs their plans are spread over the search's
    processes (`Ahead.price`) before the workers stop; the ranked outcomes are the one-process search's, priced in
    turn, figure for figure."""
    handed: list[int] = []
    price = parallel.Ahead.price

    def spy(self: parallel.Ahead, outcomes, target, variants=True):  # noqa: ANN001, ANN202
        got = price(self, outcomes, target, variants)
        handed.append(self.prices)
        return got

    monkeypatch.setattr(parallel.Ahead, "price", spy)
    space = Space(load_model("gpt-tiny"), load_hardware("a100-40g-nvlink"), 4, 32, 512, Pins(), offload=True)
    opts = PlanOptions(budget_bytes=0.05 * GiB)
    def rank(res, pricer):  # noqa: ANN001, ANN202
        return rank_for_target(res, Target.MEGATRON, 3, pricer)

    one = search(space, opts, top=3, rank=rank, rows=6)  # the 2 x top rows the ranking reads, exact (as the CLI)
    two = search(space, opts, top=3, jobs=2, rank=rank, rows=6)
    assert _table(two) == _table(one)
    assert sum(o.priced_for == "megatron" for o in one.outcomes) >= 6  # 2 x top at least
    assert handed and handed[0] >= 3, handed  # every other one of the first batch went to the worker
    assert not multiprocessing.active_children()


@pytest.mark.usefixtures("workers_at_once")
def test_lynx_plans_made_again_for_the_engine_over_the_workers_as_in_one_process() -> None:
    """--target megatron makes lynx's plans priced with --tp-comm-overlap again without it, for lynx's engine
    (`prices.engine_variant`), in whichever process prices them: the rows, their plans and the flag given by the user
    (`variants` off) are the one-process search's."""
    space = Space(load_model("llama3-8b"), load_hardware("h100-80g-nvlink"), 8, 32, 8192,
                  Pins(tp=2, pp=2, vpp=1, sp=True, mb=1, methods=("lynx-offload",)), offload=True)
    opts = PlanOptions(precision="megatron-bf16", budget_bytes=30 * GiB)
    for variants in (True, False):
        def rank(res, pricer, variants=variants):  # noqa: ANN001, ANN202
            return rank_for_target(res, Target.MEGATRON, 3, pricer, variants)

        one = search(space, opts, top=3, rank=rank, rows=6)
        two = search(space, opts, top=3, jobs=2, rank=rank, rows=6)
        assert _table(two) == _table(one)
        made = [o for o in two.ranked if o.runs_on == ENGINE_WITHOUT_UB]
        assert bool(made) == variants
        assert all(o.plan is not None and not o.plan.problem.options.tp_comm_overlap for o in made)
    assert not multiprocessing.active_children()


@pytest.mark.usefixtures("workers_at_once")
def test_an_interrupted_search_leaves_no_worker() -> None:
    """Ctrl-C in the middle of a search (the progress callback raises it, as the signal would): the search stops
    with KeyboardInterrupt and its workers are gone."""
    space = Space(load_model("gpt-tiny"), load_hardware("a100-40g-nvlink"), 4, 32, 512, Pins(), offload=True)
    seen: list[int] = []

    def progress(done: int, total: int, what: str) -> None:
        seen.append(done)
        if len(seen) == 40:
            assert multiprocessing.active_children()  # the workers are up
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        search(space, PlanOptions(budget_bytes=0.05 * GiB), progress=progress, jobs=3)
    assert not multiprocessing.active_children()


def test_a_short_search_starts_no_worker() -> None:
    """Below `run.AHEAD_AFTER_S` of searching no worker is started (a pinned layout costs no process start)."""
    space = Space(load_model("gpt-tiny"), load_hardware("a100-40g-nvlink"), 4, 32, 512,
                  Pins(tp=1, pp=2, vpp=1, mb=1, methods=("lynx",)))
    res = search(space, PlanOptions(), jobs=4)
    assert res.jobs == 1 and res.ahead == (0, 0) and res.best is not None



@pytest.mark.usefixtures("workers_at_once")
@pytest.mark.parametrize("side_by_side", [True, False], ids=["searching-beside", "planning-ahead"])
def test_a_killed_worker_does_not_stop_the_search(side_by_side: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers killed mid-search (the system's OOM killer, a user's kill): what they held is searched again in the
    search's process (the cores a worker searching beside it took, or the candidates it was planning), and the
    answer is the one-process search's; the search returns and leaves no process."""
    import os
    import signal

    monkeypatch.setattr(run, "SIDE_BY_SIDE", side_by_side)
    monkeypatch.setattr(parallel, "TAKE_BACK", False)  # wait on every handed-out candidate, the killed ones' too
    space = Space(load_model("gpt-tiny"), load_hardware("a100-40g-nvlink"), 4, 32, 512, Pins(), offload=True)
    opts = PlanOptions(budget_bytes=0.05 * GiB)
    killed: list[int] = []

    def progress(done: int, total: int, what: str) -> None:
        if not killed and multiprocessing.active_children() and done > 40:
            for p in multiprocessing.active_children():
                os.kill(p.pid, signal.SIGKILL)
                killed.append(p.pid)

    two = search(space, opts, top=3, jobs=3, progress=progress)
    assert killed
    one = _one()
    if side_by_side:
        assert _table(two) == _table(one) and two.beside == 0  # nothing came back from the killed workers
    else:
        assert _rows(two) == _rows(one)
    assert not multiprocessing.active_children()


@pytest.mark.usefixtures("workers_at_once")
def test_workers_the_system_refuses_leave_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the system refuses the worker processes (a process limit, memory), the search runs in this one, as
    --jobs 1, and says so."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(run, "Ahead", refuse)
    space = Space(load_model("gpt-tiny"), load_hardware("a100-40g-nvlink"), 4, 32, 512, Pins(), offload=True)
    opts = PlanOptions(budget_bytes=0.05 * GiB)
    res = search(space, opts, top=3, jobs=3)
    assert res.jobs == 1 and res.ahead == (0, 0)
    assert _rows(res) == _rows(_one())


def test_a_waiting_search_plans_a_queued_candidate_itself() -> None:
    """While the tree waits for a started candidate it takes back the first one still queued and plans it with its
    own caches (`Ahead._steal`): the answer `take` then returns is the one planned directly, with the simulation
    `plan_candidate` would run (`presimulate`), and the worker is told to skip it."""
    from lynx.search.evaluate import Shared, plan_candidate, plan_result, presimulate
    from lynx.search.space import layout_candidates

    space = Space(load_model("gpt-tiny"), load_hardware("a100-40g-nvlink"), 4, 32, 512, Pins(), offload=True)
    opts = PlanOptions(budget_bytes=0.05 * GiB)
    shared = Shared(space, opts)
    ahead = parallel.Ahead(space, opts, 0, shared)  # no worker process: the queue is set by hand
    cand = next(c for core in run.cores(space)[0] for v in core.vpps for c in layout_candidates(space, core.at(v))[0]
                if c.method == "lynx" and not isinstance(plan_result(shared, c), tuple))
    ahead.pending[(cand, False)] = (0, 0)
    ahead.states[0] = parallel.QUEUED
    assert ahead._steal() and not ahead._steal()  # one queued candidate, taken once
    assert ahead.states[0] == parallel.TAKEN_BACK and ahead.stolen == 1
    got = ahead.take(cand)
    assert got is not None and ahead.take(cand) is None  # returned once
    assert got.sim is not None and got.sim == presimulate(shared, cand, got.result)
    ahead_o = plan_candidate(shared, cand, 0.0, planned=got.result, simulated=got.sim)
    own_o = plan_candidate(Shared(space, opts), cand, 0.0)
    assert (ahead_o.status, ahead_o.iteration_s, ahead_o.stage_peak_gib) == \
        (own_o.status, own_o.iteration_s, own_o.stage_peak_gib)
    ahead.close()


def test_a_worker_bounds_a_screen_before_planning_it() -> None:
    """A lynx interleaved candidate handed out with a `Screen` (`parallel.work`): the worker solves its LP floors
    first and answers them, the values the search's own caches solve; at a threshold the bound exceeds it does not
    plan the candidate (pruned), at an open one it plans it as the search would."""
    from dataclasses import replace

    from lynx.search.evaluate import Shared, plan_candidate
    from lynx.search.space import Core, layout_candidates
    from lynx.search.tree import Frontier, Kind, Node

    space = Space(load_model("gpt-tiny"), load_hardware("a100-40g-nvlink"), 4, 32, 512, Pins(), offload=True)
    opts = PlanOptions(budget_bytes=0.05 * GiB)
    shared = Shared(space, opts)
    cand = next(c for core in run.cores(space)[0] for v in core.vpps if v > 1
                for c in layout_candidates(space, core.at(v))[0]
                if c.method == "lynx" and plan_candidate(shared, c, math.nan).fits)
    node = Node(Kind.LYNX, Core(replace(cand.layout, vpp=1), (cand.layout.vpp,)), cand.layout, tight=True,
                plain=True)
    own = Frontier(shared).screen_bound(node, cand.method)  # the search's own floors
    assert own > 0
    cache = shared.heu_cache(shared.problem(cand.layout), cand.layout, cand.method)

    w_shared = Shared(space, opts)
    pruned = parallel.work(w_shared, Frontier(w_shared), cand, False, parallel.Screen(node, 0.0))
    assert pruned.pruned and pruned.result is None and pruned.floors
    assert all(cache.floors[k] == v for k, v in pruned.floors.items())

    w_shared = Shared(space, opts)
    planned = parallel.work(w_shared, Frontier(w_shared), cand, False, parallel.Screen(node, math.inf))
    assert not planned.pruned and planned.floors and planned.sim is not None
    assert set(planned.floors) <= set(cache.floors)
    mine = plan_candidate(shared, cand, math.nan)
    theirs = plan_candidate(shared, cand, math.nan, planned=planned.result, simulated=planned.sim)
    assert (theirs.status, theirs.iteration_s) == (mine.status, mine.iteration_s)


@pytest.mark.usefixtures("workers_at_once")
def test_an_exhaustive_search_with_workers_is_the_one_process_one() -> None:
    """`exhaustive=True` with workers: nothing is pruned, so no candidate goes out with a screen bound for the
    workers to prune first (a pruned answer is planned by the search itself); every outcome is the one-process
    exhaustive search's."""
    space = Space(load_model("gpt-tiny"), load_hardware("a100-40g-nvlink"), 4, 32, 512, Pins(), offload=True)
    opts = PlanOptions(budget_bytes=0.05 * GiB)
    one = search(space, opts, top=3, exhaustive=True)
    two = search(space, opts, top=3, exhaustive=True, jobs=3)
    assert _rows(two) == _rows(one) and two.jobs == 3
    assert not multiprocessing.active_children()


def test_the_command_line_search_with_workers_exits_at_once_and_cleanly() -> None:
    """`lynx plan --gpus N` in a process of its own (`lynx.cli.run`, the console script's entry): once the JSON is
    written the process ends without the interpreter's teardown (`cli.common.FAST_EXIT`), with the exit code, the
    whole JSON, and no warning of a leaked semaphore (the shared tree's lock) or process on stderr."""
    import json
    import subprocess
    import sys

    code = ("import sys; import lynx.search.run as r; r.AHEAD_AFTER_S = 0.0; sys.argv = ['lynx', *sys.argv[1:]]; "
            "from lynx.cli import run; run()")
    done = subprocess.run([sys.executable, "-c", code, "plan", "--model", "gpt-tiny", "--hardware", "a100-40g-nvlink",
                           "--gpus", "4", "--global-batch", "32", "--seq-len", "512", "--jobs", "3", "--json"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["jobs"] == 3 and got["winner"] is not None  # the workers started (a search this small ends first)
    assert not any(w in done.stderr.lower() for w in ("leaked", "traceback", "warning")), done.stderr


@pytest.mark.usefixtures("workers_at_once")
def test_a_time_limit_stops_every_process_and_counts_each_candidate_once() -> None:
    """`--search-time-limit` with workers searching beside the search's process, at a limit that stops the search's
    process before a worker has started (about a second): it takes every core no process took and counts it as left,
    the workers answer their empty shares, every candidate is decided, pruned or left exactly once (the considered
    count is the one-process search's), what was left has a bound, and the search returns with no worker left."""
    one = _one()
    res = search(_space(), OPTS, top=3, jobs=3, time_limit_s=0.3)
    assert res.jobs == 3 and res.stopped and res.unplanned > 0 and res.open_bound_s > 0
    assert res.considered == one.considered
    assert len({(o.candidate, o.candidate.split) for o in res.outcomes}) == len(res.outcomes)
    assert not multiprocessing.active_children()


def test_incumbents_shared_once_keep_the_exact_threshold() -> None:
    """What one process found before the workers started goes into the shared incumbents once each: a lynx screen
    and a stock time are already among the best times, and counted again they would stand for candidates that do not
    exist and lower the threshold below the exact one (pruning a row that belongs in the table)."""
    from dataclasses import replace

    from lynx.search.evaluate import Outcome
    from lynx.search.space import layout_candidates

    space = _space()
    own, stock = layout_candidates(space, run.cores(space)[0][0].at(1))
    lynx_c = next(c for c in own if c.method == "lynx")
    stock_c = stock[0]
    inc = run._Incumbents(top=1, rows=3)
    for c, t in ((lynx_c, 1.0), (stock_c, 2.0), (replace(lynx_c, method="lynx-offload"), 3.0)):
        inc.add(Outcome(c, "planned", t, iteration_s=t))
    assert (inc.kth, inc.stock, inc.finalist) == (3.0, 2.0, 3.0)
    tree = parallel.SharedTree(multiprocessing.get_context("spawn"), 3, 2, 1, 1)
    inc.share(tree)
    assert (tree.kth, tree.stock.value, tree.finalist) == (3.0, 2.0, 3.0)
    assert (inc.kth, inc.stock, inc.finalist) == (3.0, 2.0, 3.0)
    inc.add(Outcome(stock_c, "planned", 1.5, iteration_s=1.5))  # a new time: once into each array it belongs to
    assert list(tree.best) == [1.0, 1.5, 2.0] and tree.stock.value == 1.5 and list(tree.screens) == [1.0, 3.0]
