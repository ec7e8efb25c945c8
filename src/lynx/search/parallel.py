"""lynx's own candidates planned ahead on worker processes (`lynx plan --gpus N --jobs J`: J processes in all,
the search's own and J - 1 workers).

The search's tree is sequential: the order it pops nodes in and the incumbents its bounds are compared with decide
what is planned, and that order is what makes the answer the exhaustive search's. What costs the time is planning
lynx's candidates (Lynx-HEU's stage models, its partition search and screens: about 60% of a 70B search), and that
is a pure function of the space, the options and the candidate (`evaluate.plan_result`). So the tree stays in the
main process, exactly as it was, and `Ahead` hands the lynx candidates of the nodes near the top of its heap to
workers before the tree reaches them. When the tree decides to plan one, it takes the worker's result if a worker
has started it, and plans it itself if none was handed out or it is still queued (taken back); a candidate the tree
prunes after all was planned for nothing, which costs a core that would otherwise have idled. The pick, the table
and every count but the stage problems are the sequential search's (tests/unit/test_search_parallel.py compares
them).

Workers are spawned (not forked: the parent may hold threads, the progress bar's among them), each builds its own
`Shared` caches, ignores Ctrl-C and is terminated when the search ends or is interrupted: no solve outlives it."""

from __future__ import annotations

import multiprocessing
import os
import signal
from dataclasses import dataclass
from multiprocessing.pool import AsyncResult, Pool
from typing import Any

from lynx.problem import PlanOptions, PlanResult
from lynx.search.evaluate import Failed, Shared, plan_result
from lynx.search.space import Candidate, Space

AUTO_JOBS_MAX = 8
"""`--jobs` left to lynx: one process per CPU this one may use (the search's and the workers), at most this many."""


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


QUEUED, RUNNING, DONE, TAKEN_BACK = 0, 1, 2, 3
"""A handed-out candidate's state in `Ahead.states`: a queued one the search needs now is taken back and planned in
the search's process rather than waited for behind others. One byte each, read and written without a lock (a
worker killed while holding one would stop the search): where the search takes a candidate back just as a worker
starts it, both plan it and the worker's answer is not read; the answer is the same."""
TAKE_BACK = True
"""False: `Ahead.take` waits for a queued candidate too (tests check every handed-out result is used that way)."""
WAIT_S = 300.0
"""The longest the search waits for a started candidate; then it plans it itself and hands out nothing more (a
worker the system killed never answers, and multiprocessing's pool would wait for it forever)."""
SLOTS = 1 << 16
"""Candidates one search can hand out (its states array); beyond, the search plans them itself."""

_SHARED: Shared | None = None
_STATES: Any = None


def _init(space: Space, base: PlanOptions, states: Any) -> None:
    global _SHARED, _STATES
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the search and terminates the pool
    _SHARED, _STATES = Shared(space, base), states


def _counts(shared: Shared) -> tuple[int, int]:
    return sum(h.solves for h in shared.heu.values()), sum(h.hits for h in shared.heu.values())


def _work(slot: int, cand: Candidate, refine: bool) -> Worked:
    assert _SHARED is not None, "worker used before its initializer ran"
    if _STATES[slot] == TAKEN_BACK:  # no lock (see `QUEUED`)
        return Worked(None, 0, 0)
    _STATES[slot] = RUNNING
    solves, hits = _counts(_SHARED)
    result = plan_result(_SHARED, cand, refine)
    after = _counts(_SHARED)
    _STATES[slot] = DONE
    return Worked(result, after[0] - solves, after[1] - hits)


class Ahead:
    """A pool of `workers` processes planning candidates the search hands out ahead of need."""

    def __init__(self, space: Space, base: PlanOptions, workers: int) -> None:
        self.workers = workers
        ctx = multiprocessing.get_context("spawn")
        self.states = ctx.Array("b", SLOTS, lock=False)
        self.pool: Pool = ctx.Pool(workers, initializer=_init, initargs=(space, base, self.states))
        self.pending: dict[tuple[Candidate, bool], tuple[int, AsyncResult[Worked]]] = {}
        self.running: list[AsyncResult[Worked]] = []
        self.seen: set[tuple[Candidate, bool]] = set()
        self.solves = self.hits = self.handed = self.used = 0
        self.stalled = False

    def wants(self) -> bool:
        """Room for more work: fewer than two candidates per worker not yet answered."""
        self.running = [r for r in self.running if not r.ready()]
        return not self.stalled and len(self.running) < 2 * self.workers

    def handed_out(self, cand: Candidate, refine: bool = False) -> bool:
        return (cand, refine) in self.seen

    def submit(self, cand: Candidate, refine: bool = False) -> None:
        key = (cand, refine)
        if key not in self.seen and self.handed < SLOTS:
            self.seen.add(key)
            slot = self.handed
            r = self.pool.apply_async(_work, (slot, cand, refine))
            self.pending[key] = (slot, r)
            self.running.append(r)
            self.handed += 1

    def take(self, cand: Candidate, refine: bool = False) -> PlanResult | Failed | None:
        """The worker's `plan_result` of a candidate handed out, waiting for it if a worker has started it; None if
        it was not handed out, or still queued (then it is taken back: the caller plans it)."""
        got = self.pending.pop((cand, refine), None)
        if got is None:
            return None
        slot, r = got
        if TAKE_BACK and self.states[slot] == QUEUED:
            self.states[slot] = TAKEN_BACK
            return None
        try:
            worked = r.get(timeout=WAIT_S)
        except multiprocessing.TimeoutError:
            self.stalled = True
            return None
        self.solves += worked.solves
        self.hits += worked.hits
        self.used += 1
        return worked.result

    def close(self) -> None:
        """Stop every worker now, answered or not (nothing they hold is needed once the search returns)."""
        self.pool.terminate()
        self.pool.join()
