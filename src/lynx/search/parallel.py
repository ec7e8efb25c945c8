"""Worker processes for the search (`lynx plan --gpus N --jobs J`: J processes in all, the search's own and J - 1
workers).

By default (`run.SIDE_BY_SIDE`, decision 0272) each worker searches the tree's cores beside the search's own
process (`Subtree`, `run.subtree`): the cores are taken in ascending order of their bounds through `SharedTree`,
which also holds every process's incumbents, and each worker answers what it decided (`TreePart`). The rest of this
docstring is the other mode (decision 0251), which keeps every outcome and count the one-process search's:

The search's tree is sequential: the order it pops nodes in and the incumbents its bounds are compared with decide
what is planned, and that order is what makes the answer the exhaustive search's. What costs the time is planning
lynx's candidates (Lynx-HEU's stage models, its partition search and screens: about 60% of a 70B search), and that
is a pure function of the space, the options and the candidate (`evaluate.plan_result`). So the tree stays in the
main process, exactly as it was, and `Ahead` hands the lynx candidates of the nodes near the top of its heap to
workers before the tree reaches them. When the tree decides to plan one, it takes the worker's result if a worker
has started it, and plans it itself if none was handed out or it is still queued (taken back); a candidate the tree
prunes after all was planned for nothing, which costs a core that would otherwise have idled. A worker also runs the
simulation the tree would run next on its plan (`evaluate.presimulate`), and while the tree waits for a started
candidate it takes back the first one still queued and plans it itself (`Ahead._steal`) rather than idle. An
interleaved lynx candidate whose screen bound the tree has not solved yet is handed out with it (`Screen`): the
worker solves the LP floors first, the tree reads them from its caches when it bounds the candidate. Once the tree
is done, the finalists' prices on the search's target (`targets.rank_for_target`: Megatron-Core's or torchtitan's
price of each plan, tens of simulations each) are spread over the processes too (`Ahead.price`). The
pick, the table and every count but the stage problems are the sequential search's
(tests/unit/test_search_parallel.py compares them).

Workers are spawned (not forked: the parent may hold threads, the progress bar's among them), each builds its own
`Shared` caches, ignores Ctrl-C and is terminated when the search ends or is interrupted: no solve outlives it."""

from __future__ import annotations

import contextlib
import gc
import math
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from lynx.milp import concurrent_solves
from lynx.policy.heu import CacheKey
from lynx.problem import PlanOptions, PlanProblem, PlanResult
from lynx.request import Target
from lynx.search.evaluate import Failed, Outcome, Shared, plan_result, presimulate
from lynx.search.prices import Priced, price_outcome, price_plan
from lynx.search.space import Candidate, Core, Space
from lynx.search.tree import Frontier, Node
from lynx.simulate import SimResult

MAX_JOBS = 256
"""The most processes `--jobs` takes: each worker holds its own caches (hundreds of MB on a large space), so a
count far beyond the machine's CPUs is a typo, refused before any process starts."""
AUTO_JOBS_MAX = 8
"""`--jobs` left to lynx: one process per CPU this one may use (the search's and the workers), at most this many."""


GC_YOUNG = 50_000
"""Allocations between the collector's young-generation passes during a search (CPython's default: 700). A search
keeps millions of long-lived cached objects (stage contexts, schedules, HEU answers); the default's frequent young
passes lead to full passes that re-scan all of them, far fewer at this threshold (decision 0256). Nothing the
search builds relies on the collector to be freed early."""


def _raise_young_threshold() -> tuple[int, ...]:
    """Raise the collector's young threshold to `GC_YOUNG` (never lower it); the thresholds before."""
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], GC_YOUNG), *old[1:])
    return old


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """The garbage collector's young threshold raised to `GC_YOUNG` inside, restored after."""
    old = _raise_young_threshold()
    try:
        yield
    finally:
        gc.set_threshold(*old)


def auto_jobs() -> int:
    """The CPUs this process may run on (its affinity, not the machine's count), capped at `AUTO_JOBS_MAX`."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, AUTO_JOBS_MAX))


@dataclass(frozen=True, slots=True)
class Worked:
    """A worker's answer: the candidate's `plan_result`, and the Lynx-HEU stage problems it solved and reused."""

    result: PlanResult | Failed | None
    """None: the search had taken the candidate back before this worker started it (`Ahead.take`)."""
    solves: int
    hits: int
    sim: SimResult | None = None
    """`evaluate.presimulate` of the result: the simulation the search would run next, run here too."""
    floors: dict[CacheKey, float] = field(default_factory=dict)
    """The Lynx-HEU LP floors (`HeuCache.floors` entries) the task's screen bound solved (`Screen`)."""
    pruned: bool = False
    """The screen bound pruned the candidate at the threshold it was handed out with: not planned."""
    priced: Priced | None = None
    """A `Price` task's answer (no candidate planned)."""
    part: TreePart | None = None
    """A `Subtree` task's answer."""


@dataclass(frozen=True, slots=True)
class Screen:
    """A lynx interleaved candidate handed out before the search has its screen bound (`tree.Frontier.screen_bound`,
    the Lynx-HEU LP floors of its dp split): the worker solves it first, answers the floors it solved (the search
    reads them from its own caches when it bounds the candidate: the same bound, the LPs not solved twice) and plans
    the candidate only if the bound is at most `above`, the threshold the search's incumbents set when it was handed
    out. They only get faster, so a bound above it prunes the candidate when the search decides it too."""

    node: Node
    above: float

    def prunes(self, bound: float) -> bool:
        return bound > self.above


@dataclass(frozen=True, slots=True)
class Price:
    """A finalist's plan to price on the search's target (`targets.price_plan`), once the tree is done."""

    problem: PlanProblem
    result: PlanResult
    target: Target
    stock: bool
    variants: bool = True
    """`prices.price_plan`'s: lynx's plan may be made again as the target runs it."""


QUEUED, RUNNING, DONE, TAKEN_BACK = 0, 1, 2, 3
"""A handed-out candidate's state in `Ahead.states`: a queued one the search needs now is taken back and planned in
the search's process rather than waited for behind others. One byte each, read and written without a lock (a
worker killed while holding one would stop the search): where the search takes a candidate back just as a worker
starts it, both plan it and the worker's answer is not read; the answer is the same."""
TAKE_BACK = True
"""False: `Ahead.take` waits for a queued candidate too (tests check every handed-out result is used that way)."""
WAIT_S = 300.0
"""The longest the search waits for a started candidate; then it plans it itself and hands out nothing more."""
DEPTH = 2
"""Candidates handed to a worker and not yet answered, at most (the one it plans and those queued behind it)."""
LOCK_WAIT_S = 2.0
"""How long a process waits for `SharedTree`'s lock before the search checks for a worker that died holding it."""
SLOTS = 1 << 16
"""Candidates one search can hand out (its states array); beyond, the search plans them itself."""

@dataclass(frozen=True, slots=True)
class Subtree:
    """The tree's cores for a worker to search beside the search's own process (`run.subtree`): every core in
    ascending order of its bound, taken one at a time through `SharedTree.claim` by whichever process's heap has
    nothing smaller, with the incumbents `SharedTree` holds for all of them."""

    order: tuple[int, ...]
    """Indices into `space.cores`' list, by ascending bound."""
    bounds: tuple[float, ...]
    """Each core's bound, in `order`'s order (-inf: a core whose bound is refused, reported by who takes it)."""
    top: int
    rows: int
    """`run._Incumbents.rows`: the fastest times the threshold is the slowest of."""
    exhaustive: bool
    time_left_s: float | None


class SharedTree:
    """What the processes searching one tree side by side share (`Subtree`): the next core to take, who took each,
    the incumbents (the `rows` best times, the best stock time, the `screens` best lynx screens) and each worker's
    decided count (the progress line's). Written under one lock; read without it: each figure a reader takes is a
    single aligned float, either the old value or a newer smaller one, so a bound compared with it prunes nothing
    the exact value would keep."""

    rescue: Callable[[], bool] | None = None
    """The search's own process only (set after the workers start): whether a worker is gone, which may have died
    holding the lock (the lock is held for a few microseconds, so a wait of `LOCK_WAIT_S` means it did); then the
    search releases it for it."""

    def __init__(self, ctx: Any, rows: int, screens: int, cores: int, workers: int) -> None:
        self.lock = ctx.Lock()
        self.next = ctx.RawValue("q", 0)
        self.owner = ctx.RawArray("h", max(cores, 1))
        """0: the search's own process took the core; w + 1: worker w did."""
        self.best = ctx.RawArray("d", [math.inf] * rows)
        self.screens = ctx.RawArray("d", [math.inf] * screens)
        self.stock = ctx.RawValue("d", math.inf)
        self.done = ctx.RawArray("q", max(workers, 1))
        self.cores = cores

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        while not self.lock.acquire(timeout=LOCK_WAIT_S):
            if self.rescue is not None and self.rescue():
                self.lock.release()
        try:
            yield
        finally:
            self.lock.release()

    def claim(self, i: int) -> bool:
        """Take the `i`-th core of the order: False when another process took it first."""
        with self._locked():
            if self.next.value != i:
                return False
            self.next.value = i + 1
            return True

    def claim_rest(self) -> int:
        """Take every core not yet taken (a time limit stops the search): the first index taken."""
        with self._locked():
            first = self.next.value
            self.next.value = self.cores
            return int(first)

    def add(self, seconds: float, *, best: bool = True, screen: bool = False, stock: bool = False) -> None:
        """One fitting candidate's time into the arrays it belongs to: every candidate's into `best`, a lynx
        screen's into `screens`, a stock candidate's into `stock`. Each time goes in once: a copy would stand for a
        candidate that does not exist and lower the threshold below the exact one."""
        with self._locked():
            if best:
                _insert(self.best, seconds)
            if screen:
                _insert(self.screens, seconds)
            if stock and seconds < self.stock.value:
                self.stock.value = seconds

    @property
    def kth(self) -> float:
        return float(self.best[len(self.best) - 1])

    @property
    def finalist(self) -> float:
        return float(self.screens[len(self.screens) - 1])


def _insert(arr: Any, value: float) -> None:
    """`value` into the ascending fixed-length array, the largest dropped (the caller holds the lock)."""
    i = len(arr) - 1
    if value >= arr[i]:
        return
    while i > 0 and arr[i - 1] > value:
        arr[i] = arr[i - 1]
        i -= 1
    arr[i] = value


@dataclass(frozen=True, slots=True)
class TreePart:
    """A worker's `Subtree` answer: what its share of the tree decided (`run._Run`'s fields of the same names).
    Plans are kept for the outcomes a ranking can need (`run.subtree`), dropped for the rest (they are large)."""

    outcomes: tuple[Outcome, ...]
    skipped: int
    refused: tuple[tuple[Core, str], ...]
    refused_count: int
    unplanned: int
    open_bound_s: float
    solves: int
    hits: int
    refined: tuple[Outcome, ...] = ()
    """Its finalists refined (`run._Run.refine_own`)."""


Task = tuple[int, Candidate | None, bool, Screen | Price | Subtree | None]
"""(slot, candidate, refine, screen): what the search sends a worker down its pipe (a `Price` or a `Subtree`: no
candidate)."""


def _counts(shared: Shared) -> tuple[int, int]:
    return sum(h.solves for h in shared.heu.values()), sum(h.hits for h in shared.heu.values())


SubtreeFn = Callable[[Shared, Subtree, "SharedTree", int], TreePart]
"""`run.subtree`, handed to the workers by the search (this module does not import `run`, which imports it)."""


def _serve(conn: Connection, space: Space, base: PlanOptions, states: Any, threads: int = 1,
           tree: SharedTree | None = None, me: int = 0, on_subtree: SubtreeFn | None = None) -> None:
    """A worker: plan each task from its pipe in order, answer (slot, `Worked`), until the pipe closes or says
    None, its independent stage problems solved on `threads` threads (`milp.concurrent_solves`). The parent stops
    the search on Ctrl-C and kills its workers; they ignore it themselves."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _raise_young_threshold()  # as the search's, for the worker's life
    with concurrent_solves(threads):
        _answer(conn, Shared(space, base), states, tree, me, on_subtree)


def _answer(conn: Connection, shared: Shared, states: Any, tree: SharedTree | None = None, me: int = 0,
            on_subtree: SubtreeFn | None = None) -> None:
    frontier = Frontier(shared)
    while True:
        try:
            task: Task | None = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        slot, cand, refine, screen = task
        if states[slot] == TAKEN_BACK:  # no lock (see `QUEUED`)
            conn.send((slot, Worked(None, 0, 0)))
            continue
        states[slot] = RUNNING
        if isinstance(screen, Price):
            worked = Worked(None, 0, 0, priced=price_plan(screen.problem, screen.result, screen.target, screen.stock,
                                                                  screen.variants))
        elif isinstance(screen, Subtree):
            assert tree is not None and on_subtree is not None
            worked = Worked(None, 0, 0, part=on_subtree(shared, screen, tree, me))
        else:
            assert cand is not None
            worked = work(shared, frontier, cand, refine, screen)
        states[slot] = DONE
        conn.send((slot, worked))


def work(shared: Shared, frontier: Frontier, cand: Candidate, refine: bool, screen: Screen | None) -> Worked:
    """One task of a worker, on its own caches: the screen bound first where one is asked (`Screen`), then the
    candidate's plan and its simulation."""
    solves, hits = _counts(shared)
    floors: dict[CacheKey, float] = {}
    if screen is not None:
        cache = shared.heu_cache(shared.problem(cand.layout), cand.layout, cand.method)
        before = set(cache.floors)
        bound = frontier.screen_bound(screen.node, cand.method, screen.prunes)
        floors = {k: v for k, v in cache.floors.items() if k not in before}
        if screen.prunes(bound):
            return Worked(None, 0, 0, None, floors, pruned=True)
    result = plan_result(shared, cand, refine)
    after = _counts(shared)
    return Worked(result, after[0] - solves, after[1] - hits, presimulate(shared, cand, result), floors)


class Ahead:
    """`workers` processes planning candidates the search hands out ahead of need, each on its own pipe (a worker
    killed by the system closes its pipe only: what it held is planned by the search, the others go on)."""

    def __init__(self, space: Space, base: PlanOptions, workers: int, shared: Shared | None = None,
                 threads: int = 1, tree: tuple[int, int, int] | None = None,
                 on_subtree: SubtreeFn | None = None) -> None:
        """`shared`: the search's own caches, with which it plans a queued candidate itself while it waits for a
        started one (`take`); None: it only waits. `threads`: each worker's solve threads (`_serve`). `tree`:
        (rows, screens, cores) to search the tree's cores side by side (`Subtree`, `SharedTree`), with `on_subtree`
        (`run.subtree`)."""
        ctx = multiprocessing.get_context("spawn")
        self.tree = None if tree is None else SharedTree(ctx, *tree, workers)
        self.shared = shared
        self.local: dict[tuple[Candidate, bool], Worked] = {}
        """Queued candidates the search planned itself while waiting (`_steal`), until it takes them."""
        self.stolen = 0
        self.on_floors: Callable[[Candidate, dict[CacheKey, float]], None] | None = None
        """Where a worker's LP floors go as they arrive (the search's HEU caches)."""
        self.states = ctx.Array("b", SLOTS, lock=False)
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        for _ in range(workers):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(theirs, space, base, self.states, threads, self.tree,
                                                 len(self.procs) + 1, on_subtree), daemon=True)
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(mine)
        self.load = [0] * workers
        """Tasks sent to each worker and not yet answered."""
        self.alive = set(range(workers))
        self.pending: dict[tuple[Candidate, bool], tuple[int, int]] = {}
        """Handed out, not yet taken: (slot, worker)."""
        self.answers: dict[int, Worked] = {}
        self.slots: dict[int, Candidate] = {}
        """Each slot handed out: its candidate."""
        self.screened: set[int] = set()
        """Slots handed out with a `Screen` (not taken back by `_steal`: the search bounds them first)."""
        self.seen: set[tuple[Candidate, bool]] = set()
        self.solves = self.hits = self.handed = self.used = self.prices = self.trees = 0
        self.stalled = False

    def _read(self, timeout: float) -> None:
        """Collect the answers waiting (up to `timeout` s for one); a closed pipe marks its worker dead."""
        of = {id(self.conns[w]): w for w in self.alive}
        for ready in wait([self.conns[w] for w in self.alive], timeout) if of else ():
            w = of[id(ready)]
            try:
                slot, worked = self.conns[w].recv()
            except (EOFError, OSError):
                self.alive.discard(w)
                continue
            self.load[w] -= 1
            if worked.floors and self.on_floors is not None:
                cand = self.slots.get(slot)
                if cand is not None:
                    self.on_floors(cand, worked.floors)
            if worked.result is not None or worked.pruned or worked.priced is not None or worked.part is not None:
                self.answers[slot] = worked

    def wants(self) -> bool:
        """Room for more work: fewer than two candidates per live worker not yet answered."""
        self._read(0)
        return not self.stalled and sum(self.load[w] for w in self.alive) < DEPTH * len(self.alive)

    def handed_out(self, cand: Candidate, refine: bool = False) -> bool:
        return (cand, refine) in self.seen

    def _send(self, task: Task) -> int | None:
        """Send the task to the least loaded worker: that worker (None: none took it)."""
        if task[0] >= SLOTS or self.stalled or not self.alive:
            return None
        w = min(self.alive, key=lambda i: self.load[i])
        try:
            self.conns[w].send(task)
        except OSError:  # its worker is gone
            self.alive.discard(w)
            return None
        self.load[w] += 1
        return w

    def price(self, outcomes: Sequence[Outcome], target: Target, variants: bool = True) -> list[Priced]:
        """A `targets.Pricer` over this process and the workers: every other outcome is handed out (one worker
        each in turn), the rest priced here meanwhile, then the workers' answers collected (an answer that does not
        come, its worker gone or `WAIT_S` past, is priced here)."""
        for key, (slot, _) in list(self.pending.items()):  # the tree is done: what it left queued is not needed
            if self.states[slot] == QUEUED:
                self.states[slot] = TAKEN_BACK
                del self.pending[key]
        out: list[Priced | None] = [None] * len(outcomes)
        away: dict[int, tuple[int, int]] = {}
        for i, o in enumerate(outcomes):
            assert o.plan is not None
            slot = self.handed + self.prices + self.trees
            if i % (len(self.alive) + 1) and (w := self._send((slot, None, False, Price(
                    o.plan.problem, o.plan.result, target, o.candidate.stock, variants)))) is not None:
                self.prices += 1
                away[i] = (slot, w)
        for i, o in enumerate(outcomes):
            if i not in away:
                out[i] = price_outcome(o, target, variants)
        deadline = time.monotonic() + WAIT_S
        for i, (slot, w) in away.items():
            while slot not in self.answers and w in self.alive and time.monotonic() < deadline:
                self._read(min(max(deadline - time.monotonic(), 0.0), 1.0))
            got = self.answers.pop(slot, None)
            out[i] = (got.priced if got is not None and got.priced is not None
                      else price_outcome(outcomes[i], target, variants))
        done = [p for p in out if p is not None]
        assert len(done) == len(outcomes)  # every one priced, here or by a worker
        return done

    def subtrees(self, task: Subtree) -> dict[int, int]:
        """Send every live worker the tree's cores to search beside this process: {worker: slot}."""
        sent = {}
        for w in sorted(self.alive):
            slot = self.handed + self.prices + self.trees
            try:
                self.conns[w].send((slot, None, False, task))
            except OSError:
                self.alive.discard(w)
                continue
            self.load[w] += 1
            self.trees += 1
            sent[w] = slot
        return sent

    def parts(self, sent: dict[int, int], waiting: Callable[[], None],
              wait_s: float | None) -> dict[int, TreePart | None]:
        """Each worker's answer to `subtrees` (None: its worker is gone, or `wait_s` passed with no answer; None:
        no limit, as a search without a time limit has none), calling `waiting` about once a second meanwhile."""
        deadline = math.inf if wait_s is None else time.monotonic() + wait_s
        out: dict[int, TreePart | None] = {}
        for w, slot in sent.items():
            while slot not in self.answers and w in self.alive and time.monotonic() < deadline:
                self._read(min(max(deadline - time.monotonic(), 0.0), 1.0))
                waiting()
            got = self.answers.pop(slot, None)
            out[w] = None if got is None else got.part
            if got is None:
                self.alive.discard(w)  # gone, or stalled past the limit: nothing more is sent to it
            if got is not None and got.part is not None:
                self.solves += got.part.solves
                self.hits += got.part.hits
        return out

    def submit(self, cand: Candidate, refine: bool = False, screen: Screen | None = None) -> None:
        key = (cand, refine)
        if key in self.seen:
            return
        slot = self.handed + self.prices + self.trees
        w = self._send((slot, cand, refine, screen))
        if w is None:
            return
        self.seen.add(key)
        self.slots[slot] = cand
        if screen is not None:
            self.screened.add(slot)
        self.pending[key] = (slot, w)
        self.handed += 1

    def take(self, cand: Candidate, refine: bool = False) -> Worked | None:
        """The worker's answer for a candidate handed out (its `plan_result` and `presimulate`), waiting for it if
        a worker has started it; None if it was not handed out, still queued (then it is taken back: the caller
        plans it), or its worker is gone."""
        got = self.pending.pop((cand, refine), None)
        if got is None:
            mine = self.local.pop((cand, refine), None)
            self.used += mine is not None
            return mine
        slot, w = got
        if TAKE_BACK and self.states[slot] == QUEUED:
            self.states[slot] = TAKEN_BACK
            return None
        deadline = time.monotonic() + WAIT_S
        while slot not in self.answers and w in self.alive:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stalled = True
                return None
            self._read(0 if self._steal() else min(left, 1.0))
        worked = self.answers.pop(slot, None)
        if worked is None or worked.pruned:  # a screen the worker pruned and the search plans: it plans it itself
            return None
        self.solves += worked.solves
        self.hits += worked.hits
        self.used += 1
        return worked

    def _steal(self) -> bool:
        """While the search waits for a started candidate: take back the first one still queued (handed out first:
        the tree needs it soonest, likely right after the one it waits for, which it then has as soon as both are
        planned rather than one after the other) and plan it here, as a worker would, for `take` to return when the
        tree gets to it. False when there is none (or no caches to plan with)."""
        if self.shared is None or not TAKE_BACK:
            return False
        for key, (slot, _) in self.pending.items():
            if self.states[slot] == QUEUED and slot not in self.screened:  # a screen's floors come first
                self.states[slot] = TAKEN_BACK  # its worker answers None for it
                del self.pending[key]
                result = plan_result(self.shared, key[0], key[1])
                self.local[key] = Worked(result, 0, 0, presimulate(self.shared, key[0], result))
                self.stolen += 1
                return True
        return False

    def close(self) -> None:
        """Stop every worker now, answered or not (nothing they hold is needed once the search returns)."""
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.join()
        for c in self.conns:
            c.close()
