"""Branch and bound over the configuration space (`tree`).

Nodes are expanded in ascending order of their time bound (`bounds`: static memory and the layer graph's plain
step time, on the pipeline's start-up and drain). A lynx or stock node is first checked against the memory bound
(refused candidates are reported as such), then each of its candidates is planned unless its bound exceeds the
`top`-th best iteration time found (and, for stock Megatron-Core candidates, the best stock time too): no plan
of theirs could enter the table. Once the smallest open bound exceeds both, everything left is pruned uncounted
by name (`SearchResult.skipped`).

Interleaving depth is the one dimension the bounds barely separate (the bubble shrinks as 1 / VPP, but the p2p
transfers it adds are dependency latencies no rank's busy time shows): lynx's candidates of one layout are
planned in increasing VPP (ties pop in that order), and once a deeper value was slower than the best
shallower ones, the deeper ones are skipped (`VppSweep`; a rule, not a bound). Within a node, a method is not
planned where a method that recomputes a subset of what it recomputes already fits (`dominance`: recomputing,
or copying to the host, only ever adds time). `exhaustive=True` plans everything (the tests compare both).

The cores enter the heap lazily, in ascending order of their bounds (`_Run._claim`: the order pushing them all at
once gives). With `jobs` > 1 (`SIDE_BY_SIDE`), `jobs - 1` workers take cores from that order too and search them
as trees of their own (`subtree`), every process comparing with the incumbents of all (`parallel.SharedTree`): the
`rows` fastest, the stock row and the finalists are exact in any number of processes (a bound prunes only what
cannot enter them), while which slower candidates were planned depends on timing. Every process solves a plan's
independent stage problems on `jobs` threads (`milp.concurrent_solves`: HiGHS releases the GIL). Without
`SIDE_BY_SIDE`, the tree stays in this process and the workers plan lynx's candidates of the nodes near the top of
its heap ahead of it (`parallel.Ahead`): every outcome is the one-process search's.

The published recipes that apply to the job (`recipes.applicable`) are planned always, beside the search; they do
not feed the incumbents (the table and the stock row are the search's own)."""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypedDict

from lynx.errors import LynxError
from lynx.milp import concurrent_solves
from lynx.policy.heu import CacheKey
from lynx.problem import PlanOptions, PlanResult
from lynx.search.dominance import cannot_fit, dominated, order
from lynx.search.evaluate import LYNX_SEARCHED, Failed, Outcome, Shared, plan_candidate
from lynx.search.parallel import WAIT_S, Ahead, Screen, SharedTree, Subtree, TreePart, Worked, fewer_collections
from lynx.search.prices import Pricer, price_in_turn
from lynx.search.recipes import Applied, applicable
from lynx.search.space import Candidate, Core, Rejected, Space, cores, layout_candidates
from lynx.search.tree import Frontier, Kind, Node, count, screened
from lynx.simulate import SimResult

Progress = Callable[[int, int, str], None]
"""(done, total, what): called as candidates are decided."""
Rank = Callable[["SearchResult", Pricer], "SearchResult"]
"""The result re-ranked with a pricer (`search`'s `rank`)."""


@dataclass(frozen=True, slots=True)
class SearchResult:
    space: Space
    outcomes: tuple[Outcome, ...]
    """Every candidate, planned ones fastest first, then the rest."""
    rejected: tuple[Rejected, ...]
    seconds: float
    stage_problems: int
    """Distinct Lynx-HEU stage problems solved (the rest were cache hits)."""
    stage_hits: int
    recipes: tuple[tuple[Applied, Outcome | None], ...] = ()
    """The published recipes for the job, each with its priced outcome (None: it cannot run the job)."""
    skipped: int = 0
    """Candidates pruned by their node's time bound without being built (not in `outcomes`)."""
    refused: tuple[tuple[Core, str], ...] = ()
    """Layouts (VPP open) whose static memory alone exceeds the budget (`tree.Frontier.static_reason`), with the
    reason: none of their candidates is built or listed in `outcomes` (a large cluster refuses millions)."""
    refused_count: int = 0
    """Candidates of the `refused` layouts."""
    jobs: int = 1
    """Processes that searched: this one and `jobs - 1` workers planning lynx's candidates ahead of the tree."""
    ahead: tuple[int, int] = (0, 0)
    """Candidates handed to the workers, and of those the ones whose answer the tree used (the rest it pruned, or
    planned itself while they were still queued)."""
    time_limit_s: float | None = None
    """The search's time limit (`lynx plan --search-time-limit`; None: none)."""
    unplanned: int = 0
    """Candidates left when the time limit stopped the tree (not in `outcomes`; 0 when it ran to the end)."""
    open_bound_s: float = math.nan
    """When the time limit stopped the tree: the smallest time bound of what it left, a lower bound on lynx's
    price of every `unplanned` candidate (nan when it ran to the end)."""
    best_lynx_s: float = math.nan
    """The fastest fitting candidate's iteration time in lynx's pricing (before `targets.rank_for_target`
    re-prices the finalists): what `open_bound_s` is compared with."""
    beside: int = 0
    """Candidates the workers decided, searching the tree beside this process (`run.subtree`)."""
    rows: int = 0
    """The fastest rows the search made exact (`search`'s `rows`): every candidate that could be among them was
    planned, in any number of processes."""
    priced_floor_s: float = math.nan
    """After `targets.rank_for_target`: lynx's price of the slowest of the exact rows, all of which the target
    priced; every candidate the target did not price runs at least this in lynx's pricing, and so on the target
    (inf: every fitting candidate was priced; nan: not ranked for a target)."""

    @property
    def ranked(self) -> tuple[Outcome, ...]:
        return tuple(o for o in self.outcomes if o.fits)

    @property
    def best(self) -> Outcome | None:
        return next(iter(self.ranked), None)

    @property
    def best_stock(self) -> Outcome | None:
        """The fastest stock candidate the search found (`Space.stock`'s framework; the recipes' rows are their
        own)."""
        return next((o for o in self.ranked if o.candidate.stock and not o.candidate.recipe), None)

    @property
    def best_recipe(self) -> Outcome | None:
        fits = [o for _, o in self.recipes if o is not None and o.fits]
        return min(fits, key=lambda o: o.iteration_s, default=None)

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    @property
    def considered(self) -> int:
        return len(self.outcomes) + self.skipped + self.refused_count + self.unplanned

    @property
    def stopped(self) -> bool:
        """The time limit stopped the tree before every candidate was decided."""
        return self.unplanned > 0

    @property
    def over_memory_bound(self) -> int:
        """Candidates refused by a memory bound: listed ones, and those of the layouts refused whole."""
        return self.count("over budget (bound)") + self.refused_count

    @property
    def pruned(self) -> int:
        return (self.skipped + self.count("pruned (time bound)") + self.over_memory_bound
                + self.count("skipped (VPP sweep)") + self.count("dominated"))

    @property
    def simulated(self) -> int:
        """Planned candidates the event simulator judged (the rest were refused on their policy's held
        activations before simulation, or had no policy that fits)."""
        return sum(not math.isnan(o.iteration_s) for o in self.outcomes)

    @property
    def planned(self) -> int:
        """Candidates that went through the planner (fitting or not)."""
        return self.count("planned") + self.count("does not fit")


class _Incumbents:
    """The `top` best iteration times overall and the best stock time: what a bound must beat."""

    def __init__(self, top: int, rows: int | None = None) -> None:
        self.top = top
        self.rows = top if rows is None else rows
        """The fastest times kept: `kth` is the slowest of them (the table's rows a ranking reads, exact)."""
        self.heap: list[float] = []  # negated: the worst of the best `top` on top
        self.own_stock = math.inf
        self.screens: list[float] = []  # negated: the `2 top` fastest lynx screens (`_refine_finalists`' set)
        self.tree: SharedTree | None = None
        """The incumbents of every process searching the tree side by side (`parallel.SharedTree`), once shared."""

    def share(self, tree: SharedTree) -> None:
        """From now on, compare with every process's incumbents: this one's so far go into `tree` first."""
        for t in self.heap:
            tree.add(-t)
        for t in self.screens:
            tree.add(-t, best=False, screen=True)
        if self.own_stock < math.inf:
            tree.add(self.own_stock, best=False, stock=True)
        self.tree = tree

    def add(self, o: Outcome) -> None:
        if not o.fits:
            return
        if self.tree is not None:
            self.tree.add(o.iteration_s, screen=o.candidate.method in LYNX_SEARCHED, stock=o.candidate.stock)
        heapq.heappush(self.heap, -o.iteration_s)
        if len(self.heap) > self.rows:
            heapq.heappop(self.heap)
        if o.candidate.stock:
            self.own_stock = min(self.own_stock, o.iteration_s)
        if o.candidate.method in LYNX_SEARCHED:
            heapq.heappush(self.screens, -o.iteration_s)
            if len(self.screens) > 2 * self.top:
                heapq.heappop(self.screens)

    @property
    def kth(self) -> float:
        own = -self.heap[0] if len(self.heap) >= self.rows else math.inf
        return own if self.tree is None else min(own, self.tree.kth)

    @property
    def stock(self) -> float:
        """The best stock time."""
        return self.own_stock if self.tree is None else min(self.own_stock, self.tree.stock.value)

    @property
    def finalist(self) -> float:
        """The slowest screen time of a lynx candidate the finalists' refinement would still take."""
        own = -self.screens[0] if len(self.screens) >= 2 * self.top else math.inf
        return own if self.tree is None else min(own, self.tree.finalist)

    def split_bound_prunes(self, bound: float) -> bool:
        """A bound that holds for lynx's screen on its dp split only (`tree.Node.tight`): refinement may move the
        finalists' partitions below it, so it prunes only a candidate that cannot be a finalist either."""
        return bound > self.split_threshold

    @property
    def split_threshold(self) -> float:
        """The bound above which `split_bound_prunes` prunes."""
        return max(self.kth, self.finalist)

    def prunes(self, cand: Candidate, bound: float) -> bool:
        return bound > self.threshold(cand)

    def threshold(self, cand: Candidate) -> float:
        """The bound above which the candidate is pruned: the `top`-th best time, and for a stock candidate the
        best stock time too."""
        return max(self.kth, self.stock) if cand.stock else self.kth

    def prunes_node(self, node: Node, bound: float) -> bool:
        """A core holds stock candidates too: it must beat the stock time as well."""
        if node.tight:
            return self.split_bound_prunes(bound)
        return bound > self.kth and (node.kind == Kind.LYNX or bound > self.stock)


class VppSweep:
    """lynx's candidates of one layout by VPP: a VPP is skipped once, among the VPPs below it planned so far, the
    deepest was slower than the best shallower one (see the module's docstring). Only values below count, so the
    rule does not depend on the order the tree's bounds pop them in."""

    def __init__(self) -> None:
        self.seen: dict[tuple[object, ...], dict[int, float]] = {}

    @staticmethod
    def _key(c: Candidate) -> tuple[object, ...] | None:
        return None if c.stock else (replace(c.layout, vpp=1), c.method)

    def skips(self, c: Candidate) -> str:
        key = self._key(c)
        got = self.seen.get(key, {}) if key is not None and c.layout.vpp > 1 else {}
        times = [t for v, t in sorted(got.items()) if v < c.layout.vpp]
        if len(times) >= 2 and times[-1] > min(times[:-1]):
            return f"VPP sweep: deeper interleaving of this layout got slower (best {min(times):.3f} s)"
        return ""

    def add(self, o: Outcome) -> None:
        key = self._key(o.candidate)
        if key is not None and o.candidate.layout.vpp > 1:  # VPP 1 is a schedule of its own (1F1B)
            self.seen.setdefault(key, {})[o.candidate.layout.vpp] = o.iteration_s if o.fits else math.inf


def _refine_finalists(shared: Shared, outcomes: list[Outcome], n: int, ahead: Ahead | None,
                      done: dict[Candidate, Outcome] | None = None) -> list[Outcome]:
    """lynx's simulator-judged partition refinement (up to 40 simulations each) for the `n` fastest lynx
    candidates only: it moves a plan by a fraction of a percent, and screening every candidate with it would
    multiply the search's time by ten (docs/decisions/0069-configuration-search.md). With workers, each
    finalist's refinement runs on one. `done`: refinements the processes searching side by side already made of
    their own finalists (`_Run.refine_own`)."""
    done = done or {}
    lynx = sorted((o for o in outcomes if o.fits and o.candidate.method in LYNX_SEARCHED),
                  key=lambda o: o.iteration_s)[:n]
    better = {id(o): done[o.candidate] for o in lynx if o.candidate in done}
    lynx = [o for o in lynx if id(o) not in better]
    if ahead is not None:
        for o in lynx:
            ahead.submit(o.candidate, refine=True)
    better |= {id(o): plan_candidate(shared, o.candidate, o.bound_s, refine=True,
                                     **_worked(None if ahead is None else ahead.take(o.candidate, refine=True)))
               for o in lynx}
    return [better.get(id(o), o) for o in outcomes]


class _Ahead(TypedDict):
    planned: PlanResult | Failed | None
    simulated: SimResult | None


def _worked(w: Worked | None) -> _Ahead:
    """A worker's answer as `plan_candidate`'s keywords (None: nothing computed ahead)."""
    return {"planned": None, "simulated": None} if w is None else {"planned": w.result, "simulated": w.sim}


HANDED_STOCK = ("block",)
"""Stock methods whose candidates the workers plan ahead too: block chooses its N by replaying the stage's memory
for each (about 5-13 ms a candidate on the 70B search); the others' policies take a millisecond or two, about what
handing one out costs."""

SIDE_BY_SIDE = True
"""With workers (`--jobs` > 1), they search the tree's cores beside the search's own process (`subtree`); False:
they plan the search's lynx candidates ahead of its tree (`_hand_out`)."""

AT_ONCE = 100_000
"""Candidates from which the workers start with the search rather than after `AHEAD_AFTER_S`: such a space's core
bounds alone take most of a second, and a worker takes about a second to start (spawned, its imports)."""

AHEAD_AFTER_S = 1.0
"""Seconds of searching before the workers start: a search that ends sooner (a pinned layout, a small job) does
not pay for starting them (about half a second of imports each)."""


class _Run:
    """One search's state: the frontier, the incumbents, the outcomes decided so far."""

    LOOK = 31
    """Heap entries `_hand_out` looks at: the heap's top five levels, where the next nodes to pop are."""

    def __init__(self, space: Space, base: PlanOptions, top: int, exhaustive: bool,
                 progress: Progress | None, jobs: int = 1, time_limit_s: float | None = None,
                 shared: Shared | None = None, rows: int | None = None) -> None:
        self.shared = Shared(space, base) if shared is None else shared
        self.jobs, self.t0 = jobs, time.perf_counter()
        self.time_limit_s = time_limit_s
        self.unplanned, self.open_bound_s = 0, math.nan
        self.ahead: Ahead | None = None
        self.handed: set[int] = set()
        """Heap entries (their insertion numbers: a node's each push is its own) `_hand_out` has looked at. Not
        the nodes: hashing a node hashes its layouts, and `_hand_out` asks of the heap's top after every step."""
        self.frontier = Frontier(self.shared, floors=not exhaustive)
        self.inc, self.sweep = _Incumbents(top, rows), VppSweep()
        self.top, self.exhaustive, self.progress = top, exhaustive, progress
        self.outcomes: list[Outcome] = []
        self.skipped = self.done = self.total = self.refused_count = 0
        self.rejected: list[Rejected] = []
        self.refused: list[tuple[Core, str]] = []
        self.nodes: list[Node] = []
        """The cores, in `space.cores`' order."""
        self.order: list[int] = []
        """`nodes` indices by ascending bound: the order the cores enter the heap in (`_claim`)."""
        self.bounds: list[float] = []
        """Their bounds in that order (-inf: the bound was refused; the core is reported invalid when taken)."""
        self.next = 0
        """The first core in `order` not yet taken (with a `tree`, its `next` is)."""
        self.tree: SharedTree | None = None
        """Shared with the workers searching the same tree side by side (`_start_workers`, `subtree`)."""
        self.me = 0
        """This process in `tree`: 0 the search's own, w + 1 worker w."""
        self.sent: dict[int, int] = {}
        """The workers searching a `Subtree` and their answers' slots."""
        self.beside = 0
        """Candidates the workers decided (`SearchResult.beside`)."""
        self.refined: dict[Candidate, Outcome] = {}
        """Finalists refined by the process that planned them, at the end of its share of the tree (`refine_own`)."""

    def tick(self, n: int, what: str) -> None:
        self.done += n
        if self.tree is not None and self.me:
            self.tree.done[self.me - 1] = self.done
        if self.progress is not None:
            self.progress(self.done + self._others(), self.total, what)

    def _others(self) -> int:
        """Candidates the workers searching the tree beside this process have decided so far."""
        return 0 if self.tree is None or self.me or not self.sent else sum(self.tree.done[w] for w in self.sent)

    def run(self, part: Subtree | None = None) -> None:
        cs, self.rejected = cores(self.shared.space)
        self.nodes = [Node(Kind.CORE, c) for c in cs]
        self.total = sum(count(self.shared.space, n) for n in self.nodes)
        if self.jobs > 1 and self.total >= AT_ONCE:  # a search this large outlasts the workers' start
            self._start_workers()
        if part is None:
            bounds = []
            for n in self.nodes:
                self._maybe_start_workers()  # a large space's cores take seconds: the workers start meanwhile
                try:
                    bounds.append(self.frontier.bound(n))
                except LynxError:  # reported when the core is taken (`_push_core`)
                    bounds.append(-math.inf)
            self.order = sorted(range(len(self.nodes)), key=lambda i: (bounds[i], i))
            self.bounds = [bounds[i] for i in self.order]
        else:
            self.order, self.bounds = list(part.order), list(part.bounds)
        self._loop()
        if self.sent:
            self._join()

    def _claim(self) -> None:
        """Take the next cores in bound order while none in the heap has a smaller bound: the heap pops what it
        would pop with every core pushed at once (a core's insertion number is below every node pushed after the
        start, as it was). With a `tree`, each is taken by one process only: the processes' heaps together pop
        the cores in that order."""
        heap, n = self.frontier.heap, len(self.order)
        while True:
            i = self.tree.next.value if self.tree is not None else self.next
            if i >= n or (heap and heap[0][0] < self.bounds[i]):
                return
            if self.tree is not None:
                if not self.tree.claim(i):
                    continue
                self.tree.owner[self.order[i]] = self.me
            else:
                self.next = i + 1
            self._push_core(i)

    def _push_core(self, i: int) -> None:
        node = self.nodes[self.order[i]]
        if self.bounds[i] == -math.inf:
            self.frontier.push(node)  # its refusal, into `frontier.invalid`
        else:
            self.frontier.push_at(node, self.bounds[i], i - len(self.order))

    def _loop(self) -> None:
        while True:
            self._claim()
            if not self.frontier:
                break
            if self.time_limit_s is not None and time.perf_counter() - self.t0 > self.time_limit_s:
                self._stop()
                break
            bound, node = self.frontier.pop()
            if not self.exhaustive and self.inc.prunes_node(node, bound):
                self._prune(node, bound)
            elif self.frontier.tighten(node, bound, self.inc.split_bound_prunes):  # also when exhaustive (no floors
                continue  # there): the bounds test covers it
            elif node.kind == Kind.CORE:
                why = self.frontier.static_reason(node.core)
                if why:
                    self._refuse(node, why)
                else:
                    self.frontier.expand(node)
            else:
                self._plan(node, bound)
            for bad, why in self.frontier.invalid:
                self._invalid(bad, why)
            self.frontier.invalid.clear()
            self._maybe_start_workers()
            if self.ahead is not None and self.tree is None and self.ahead.tree is not None:
                self._side_by_side()
            if self.ahead is not None and self.tree is None and self.ahead.wants():
                self._hand_out()

    def _stop(self) -> None:
        """The time limit: the open nodes the incumbents prune are counted as pruned, the rest as unplanned, with the
        smallest of their bounds (each a lower bound on lynx's price of its candidates: what the pick is within).
        The cores no process has taken yet are this one's to count."""
        left = [(b, n) for b, _, n in self.frontier.heap]
        self.frontier.heap.clear()
        first = self.tree.claim_rest() if self.tree is not None else self.next
        self.next = len(self.order)
        for i in range(first, len(self.order)):
            if self.bounds[i] == -math.inf:
                self._push_core(i)
            else:
                left.append((self.bounds[i], self.nodes[self.order[i]]))
        live = []
        for b, n in left:
            if self.inc.prunes_node(n, b):
                self._prune(n, b)
            else:
                live.append((b, n))
        self.open_bound_s = min((b for b, _ in live), default=math.nan)
        self.unplanned = sum(count(self.shared.space, n) for _, n in live)
        if self.unplanned:
            self.tick(self.unplanned, "not planned (search time limit)")

    def _start_workers(self) -> None:
        """Start the workers; where the system refuses processes (a limit, memory) the search goes on in this one
        process, as `--jobs 1` (the same answer), and says so (`SearchResult.jobs`). With `SIDE_BY_SIDE`, each
        worker searches the cores no process has taken yet beside this one (`subtree`), sharing the incumbents."""
        try:
            self.ahead = Ahead(self.shared.space, self.shared.base, self.jobs - 1, self.shared, self.jobs,
                               tree=(self.inc.rows, 2 * self.top, len(self.nodes)) if SIDE_BY_SIDE else None,
                               on_subtree=subtree)
        except OSError:
            self.jobs = 1
            return
        self.ahead.on_floors = self._floors_in

    def _maybe_start_workers(self) -> None:
        if self.ahead is None and self.jobs > 1 and time.perf_counter() - self.t0 > AHEAD_AFTER_S:
            self._start_workers()

    def _side_by_side(self) -> None:
        """Hand every worker the cores no process has taken yet, to search beside this one (`subtree`), the
        incumbents shared from now on."""
        assert self.ahead is not None and self.ahead.tree is not None
        self.tree = self.ahead.tree
        procs = self.ahead.procs
        self.tree.rescue = lambda: any(not p.is_alive() for p in procs)
        self.tree.next.value = self.next
        self.inc.share(self.tree)
        left = None if self.time_limit_s is None else max(self.time_limit_s - (time.perf_counter() - self.t0), 0.0)
        self.sent = self.ahead.subtrees(Subtree(tuple(self.order), tuple(self.bounds), self.top, self.inc.rows,
                                                self.exhaustive, left))

    def refine_own(self) -> None:
        """This process's share of the tree is done: refine its own finalists (`_refine_finalists`), those among the
        `2 top` fastest lynx screens of every process so far, while another process may still be searching. What
        this process planned is final, and the threshold only falls, so every finalist it holds is among these."""
        threshold = self.inc.finalist
        for o in sorted(self.outcomes, key=lambda o: o.iteration_s if o.fits else math.inf):
            if not o.fits or o.iteration_s > threshold:
                break
            if o.candidate.method in LYNX_SEARCHED and o.candidate not in self.refined:
                self.refined[o.candidate] = plan_candidate(self.shared, o.candidate, o.bound_s, refine=True)

    def _join(self) -> None:
        """This process's share of the tree is done: refine its finalists (`refine_own`), then take in each worker's
        (`TreePart`); the cores of a worker that did not answer (gone) are searched here again, whole."""
        assert self.ahead is not None and self.tree is not None
        tree = self.tree
        self.refine_own()

        def waiting() -> None:
            if self.progress is not None:
                self.progress(self.done + self._others(), self.total, "waiting for the workers' share of the tree")

        wait_s = None if self.time_limit_s is None else max(self.time_limit_s - (time.perf_counter() - self.t0),
                                                             0.0) + WAIT_S
        parts = self.ahead.parts(self.sent, waiting, wait_s)
        lost = set()
        for w, part in parts.items():
            if part is None:
                lost.add(w + 1)
                continue
            self.done += tree.done[w]
            self.beside += tree.done[w]
            self.outcomes += part.outcomes
            self.skipped += part.skipped
            self.refused += part.refused
            self.refused_count += part.refused_count
            self.unplanned += part.unplanned
            self.open_bound_s = min((b for b in (self.open_bound_s, part.open_bound_s) if not math.isnan(b)),
                                    default=math.nan)
            self.refined.update({o.candidate: o for o in part.refined})
        self.sent = {}
        if lost:
            self._search_again(lost)

    def _search_again(self, lost: set[int]) -> None:
        """The cores the `lost` workers took, searched here whole. Alone now, against incumbents rebuilt from the
        outcomes this process holds: the shared ones still count the lost workers' times, which are searched again
        and would be counted twice."""
        assert self.tree is not None
        tree, self.tree = self.tree, None
        self.inc = _Incumbents(self.top, self.inc.rows)
        for o in self.outcomes:
            self.inc.add(o)
        self.next = len(self.order)  # every core was taken by some process
        for i in range(min(tree.next.value, len(self.order))):
            if tree.owner[self.order[i]] in lost:
                self._push_core(i)
        self._loop()

    def _floors_in(self, cand: Candidate, floors: dict[CacheKey, float]) -> None:
        """A worker's LP floors for the candidate's stage problems, into the search's HEU cache of its method (the
        values it would solve itself: `screen_bound` reads them)."""
        cache = self.shared.heu_cache(self.shared.problem(cand.layout), cand.layout, cand.method)
        for k, v in floors.items():
            cache.floors.setdefault(k, v)

    def _hand_out(self) -> None:
        """Hand the workers the lynx candidates of the heap's top nodes that the tree will plan when it pops them
        unless the incumbents have moved by then: nodes past their last tightening but the screen bounds (1F1B, or
        interleaved with the plain bound), not pruned now, whose candidates pass the memory bounds (the same cached
        answers the tree reads), the VPP sweep so far and the screen bound (solved here for a plain node, before the
        tree pops it to tighten it by that bound: the workers get their lead)."""
        assert self.ahead is not None
        for bound, seq, node in self.frontier.heap[:self.LOOK]:
            if node.kind == Kind.STOCK:
                self._hand_out_stock(node, bound, seq)
                continue
            if node.kind != Kind.LYNX or node.layout is None or not (not screened(node.layout) or node.plain):
                continue
            if seq in self.handed or (not self.exhaustive and self.inc.prunes_node(node, bound)):
                continue
            self.handed.add(seq)  # its candidates are looked at once (the heap's top stays put for a while)
            for c in sorted(self.frontier.candidates(node), key=lambda c: order(c.method)):
                if c.method not in LYNX_SEARCHED or self.ahead.handed_out(c):
                    continue
                if self.frontier.memory_reason(node, c) or (not self.exhaustive and self.sweep.skips(c)):
                    continue
                if node.plain and self.frontier.floors and (node.layout, c.method) not in self.frontier.screens:
                    self.ahead.submit(c, screen=Screen(node, self.inc.split_threshold))  # the worker bounds it
                    continue
                if node.plain and self.inc.split_bound_prunes(self.frontier.screen_bound(node, c.method,
                                                                                        self.inc.split_bound_prunes)):
                    continue  # the tree prunes it when it decides it (the incumbents only get faster)
                self.ahead.submit(c)

    def _hand_out_stock(self, node: Node, bound: float, seq: int) -> None:
        """A stock node's candidates of the methods whose policies take longest to choose (`HANDED_STOCK`: block
        tries each N against the memory replay), unless the memory bounds, the node's split or their method's bound
        already refuse them; the tree still decides each one in order (dominance, the policy's bound)."""
        assert self.ahead is not None
        if seq in self.handed or (not self.exhaustive and self.inc.prunes_node(node, bound)):
            return
        self.handed.add(seq)
        if self.frontier.split_reason(node):
            return
        for c in self.frontier.candidates(node):
            if c.method not in HANDED_STOCK or self.ahead.handed_out(c) or self.frontier.memory_reason(node, c):
                continue
            if not self.exhaustive and self.inc.prunes(c, max(bound, self.frontier.method_bound(node, c))):
                continue
            self.ahead.submit(c)

    def _prune(self, node: Node, bound: float) -> None:
        n = count(self.shared.space, node)
        self.skipped += n
        self.tick(n, f"pruned at bound {bound:.3f} s")

    def _refuse(self, node: Node, why: str) -> None:
        """A core whose static memory alone exceeds the budget for every split (`Frontier.static_reason`): counted,
        listed once with its reason, its candidates never built."""
        n = count(self.shared.space, node)
        self.refused.append((node.core, why))
        self.refused_count += n
        self.tick(n, "over budget (bound)")

    def _invalid(self, node: Node, why: str) -> None:
        if node.kind == Kind.CORE:
            for v in node.core.vpps:
                own, stock = layout_candidates(self.shared.space, node.core.at(v))
                self.outcomes += [Outcome(c, "invalid", math.nan, why) for c in own + stock]
            self.tick(count(self.shared.space, node), "invalid")
            return
        cands = self.frontier.candidates(node)
        self.outcomes += [Outcome(c, "invalid", math.nan, why) for c in cands]
        self.tick(len(cands), "invalid")

    def _taken(self, c: Candidate) -> _Ahead:
        """A worker's `plan_result` and `presimulate` of the candidate where one was handed out (None: plan it
        here), as `plan_candidate`'s keywords."""
        return _worked(None if self.ahead is None else self.ahead.take(c))

    def _plan(self, node: Node, bound: float) -> None:
        why = self.frontier.split_reason(node) if node.kind == Kind.STOCK else ""
        if why:
            self._invalid(node, why)
            return
        fits: dict[str, Outcome] = {}
        failed: set[str] = set()
        for c in sorted(self.frontier.candidates(node), key=lambda c: order(c.method)):
            o = self._decide(node, c, bound, fits, failed)
            if o.fits:
                fits[c.method] = o
            elif o.status in ("does not fit", "over budget (bound)"):
                failed.add(c.method)
            self.outcomes.append(o)
            self.tick(1, f"{c.layout.label()} {c.method}")

    def _prunes(self, node: Node, c: Candidate, bound: float) -> bool:
        return self.inc.split_bound_prunes(bound) if node.tight else self.inc.prunes(c, bound)

    def _decide(self, node: Node, c: Candidate, bound: float, fits: dict[str, Outcome], failed: set[str]) -> Outcome:
        why = self.frontier.memory_reason(node, c) or cannot_fit(c.method, failed)
        if why:
            return Outcome(c, "over budget (bound)", bound, why)
        cheaper = "" if self.exhaustive else dominated(c.method, fits)
        if cheaper:
            return Outcome(c, "dominated", bound, f"no faster than {cheaper}, which fits this layout")
        if node.kind == Kind.STOCK:  # its method's recomputation on top of the split's bound
            bound = max(bound, self.frontier.method_bound(node, c))  # SAFETY applied by the bound itself
        skip = "" if self.exhaustive else self.sweep.skips(c)
        if skip:
            return Outcome(c, "skipped (VPP sweep)", bound, skip)
        if not self.exhaustive and self._prunes(node, c, bound):
            return Outcome(c, "pruned (time bound)", bound,
                           f"time bound {bound:.3f} s exceeds the {self.inc.rows} best found")
        if node.floored and c.method in LYNX_SEARCHED:  # HEU's least on-demand work (LPs)
            bound = max(bound, self.frontier.screen_bound(node, c.method, self.inc.split_bound_prunes))
            if self._prunes(node, c, bound):
                return Outcome(c, "pruned (time bound)", bound, f"time bound {bound:.3f} s (its stage models' "
                               f"least on-demand recomputation) exceeds the {self.inc.rows} best found")
        if node.kind == Kind.STOCK and not self.exhaustive:  # its policy's bound before it is simulated
            o = plan_candidate(self.shared, c, bound, prune_above=self.inc.threshold(c),
                               policy_bound=lambda p, r: self.frontier.policy_bound(node, p, r), **self._taken(c))
        else:
            o = plan_candidate(self.shared, c, bound, **self._taken(c))
        self.inc.add(o)
        self.sweep.add(o)
        return o


def subtree(shared: Shared, task: Subtree, tree: SharedTree, me: int) -> TreePart:
    """A worker's share of the tree (`parallel.Subtree`): the cores it takes, searched on its own caches with the
    incumbents of every process. The plans it answers are those a ranking can still need (`targets.rank_for_target`
    prices at most `8 top` of the fastest and the fastest stock ones); the rest keep their figures only."""
    r = _Run(shared.space, shared.base, task.top, task.exhaustive, None, 1, task.time_left_s, shared, task.rows)
    r.tree, r.me = tree, me
    r.inc.share(tree)
    r.run(task)
    r.refine_own()
    fits = sorted((o for o in r.outcomes if o.fits), key=lambda o: o.iteration_s)
    keep = {id(o) for o in fits[:8 * task.top]} | {id(o) for o in [o for o in fits if o.candidate.stock][:8 * task.top]}
    outs = tuple(o if o.plan is None or id(o) in keep else replace(o, plan=None) for o in r.outcomes)
    solves, hits = sum(h.solves for h in shared.heu.values()), sum(h.hits for h in shared.heu.values())
    return TreePart(outs, r.skipped, tuple(r.refused), r.refused_count, r.unplanned, r.open_bound_s, solves, hits,
                    tuple(r.refined.values()))


def _finish(r: _Run, space: Space, top: int) -> tuple[list[Outcome], tuple[tuple[Applied, Outcome | None], ...]]:
    """Run the tree, refine its finalists, price the published recipes (the caller stops the workers)."""
    r.run()
    final = _refine_finalists(r.shared, r.outcomes, 2 * top, r.ahead, r.refined)
    applied = applicable(space)
    if r.ahead is not None:
        for a in applied:
            if a.candidate is not None:
                r.ahead.submit(a.candidate)
    recipes = tuple((a, None if a.candidate is None else plan_candidate(r.shared, a.candidate, math.nan,
                                                                           **r._taken(a.candidate)))
                    for a in applied)
    return final, recipes


def search(space: Space, base: PlanOptions | None = None, top: int = 5, exhaustive: bool = False,
           progress: Progress | None = None, jobs: int = 1, time_limit_s: float | None = None,
           rank: Rank | None = None, rows: int | None = None) -> SearchResult:
    """Plan the space's candidates, pruning by bounds unless `exhaustive`; price the published recipes. `rows`: the
    fastest rows made exact (every candidate that could be among them planned; default `top`). `jobs` > 1: this
    process and `jobs - 1` workers, which search the tree beside it, then plan the finalists' refinements and the
    recipes (the same exact rows, stock row and recipes). They are spawned, so a script that asks for them must
    guard its entry point with ``if __name__ == "__main__":``, as Python's multiprocessing requires. `time_limit_s`:
    the tree stops deciding candidates after this long (the finalists' refinement and the recipes still run) and the
    result says what it left and the smallest bound among it (`SearchResult.open_bound_s`), as a MILP solver stopped
    at its time limit reports its gap; an exhaustive search has none. `rank`: what the result becomes before the
    workers stop, given a `prices.Pricer` over the search's processes (`targets.rank_for_target` for the CLI's
    --target; `seconds` is the search's own)."""
    t0 = time.perf_counter()
    r = _Run(space, base or PlanOptions(), top, exhaustive, progress, jobs, None if exhaustive else time_limit_s,
             rows=rows)
    try:
        with fewer_collections(), concurrent_solves(jobs):
            final, recipes = _finish(r, space, top)
            res = _result(r, space, final, recipes, jobs, t0)
            if rank is not None:
                if progress is not None:
                    progress(r.done, r.total, "ranking the finalists")
                res = rank(res, price_in_turn if r.ahead is None else r.ahead.price)
    finally:
        if r.ahead is not None:
            r.ahead.close()
    return res


def _result(r: _Run, space: Space, final: list[Outcome], recipes: tuple[tuple[Applied, Outcome | None], ...],
            jobs: int, t0: float) -> SearchResult:
    ahead = r.ahead
    final.sort(key=lambda o: (not o.fits, o.iteration_s if o.fits else math.inf, o.candidate.layout,
                              o.candidate.method, o.candidate.split.key()))
    heu = r.shared.heu.values()
    solves, hits = (ahead.solves, ahead.hits) if ahead is not None else (0, 0)
    return SearchResult(space, tuple(final), tuple(r.rejected), time.perf_counter() - t0,
                        solves + sum(h.solves for h in heu), hits + sum(h.hits for h in heu), recipes, r.skipped,
                        tuple(r.refused), r.refused_count, jobs if ahead is not None else 1,
                        (ahead.handed, ahead.used) if ahead is not None else (0, 0), r.time_limit_s, r.unplanned,
                        r.open_bound_s, next((o.iteration_s for o in final if o.fits), math.nan), r.beside,
                        r.inc.rows)
