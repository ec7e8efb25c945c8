"""What a schedule implies for each (rank, chunk), derived once from the action list. Every consumer
(StageContext, HEU's objective and cache key, OPT's in-flight term, the memory closed form, the simulator,
the runtime's predictor) reads these; nobody re-derives them from p and s.

* in flight: the most micro-batches of the chunk whose forward has run and whose backward has not, at any
  point of the rank's list (1F1B: min(p - s, m); the first rank holds more under interleaving).
* forwards between F(j) and B(j): the forward passes (any chunk) run on the rank while micro-batch j's
  activations are held. Their collectives are where phase-1/2 recomputation for B(j) could hide.
* host of B(j): the forward immediately before B(j) on the rank, when it is not F(j) itself; phases 1 and
  2 of B(j) run in its windows (the paper's "F(j+k) before B(j)"). A forward hosts at most one backward.
* cool-down backwards: those of a chunk with forward windows that have no host; their phase-1/2 work hides
  in the stall before them (paper sec. 4.2) or runs on demand.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from operator import ge

from lynx.schedule.actions import Action, ActionKind, Schedule

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741  (torch's letters)
ChunkMb = tuple[int, int]
"""(chunk, micro-batch) on one rank."""


@dataclass(frozen=True, slots=True)
class ChunkFacts:
    rank: int
    chunk: int
    num_microbatches: int
    in_flight: int
    forwards: tuple[ChunkMb, ...]
    """The rank's forwards (chunk, micro-batch) in its list's order (shared by its chunks)."""
    spans: tuple[tuple[int, int], ...]
    """Per micro-batch j: the slice of `forwards` that runs between F(j) and B(j) (kept as indices: the
    forwards themselves are quadratic in the micro-batches)."""
    hosts: tuple[tuple[int, ChunkMb], ...]
    """(j, forward) pairs: the forward whose windows host B(j)'s phase-1/2 recomputation."""
    has_fwd_windows: bool
    """Some forward runs between F(j) and B(j) (not on the last stage, nor with one micro-batch)."""
    cooldown: frozenset[int]
    """Backward micro-batches with forward windows in general but no host of their own (derived once: every
    stage context of a search reads it)."""

    @staticmethod
    def of_spans(rank: int, chunk: int, num_microbatches: int, in_flight: int, forwards: tuple[ChunkMb, ...],
                 spans: tuple[tuple[int, int], ...], hosts: tuple[tuple[int, ChunkMb], ...]) -> ChunkFacts:
        """The facts, with whether forward windows exist and the cool-down backwards derived from the spans."""
        windows = any(hi > lo for lo, hi in spans)
        hosted = {j for j, _ in hosts}
        cooldown = frozenset(j for j in range(num_microbatches) if j not in hosted) if windows else frozenset()
        return ChunkFacts(rank, chunk, num_microbatches, in_flight, forwards, spans, hosts, windows, cooldown)

    @property
    def between(self) -> tuple[tuple[ChunkMb, ...], ...]:
        """Per micro-batch j: the forwards (chunk, micro-batch) that run on the rank between F(j) and B(j)."""
        return tuple(self.forwards[lo:hi] for lo, hi in self.spans)

    @property
    def cooldown_count(self) -> int:
        return len(self.cooldown)


@dataclass(frozen=True, slots=True)
class ScheduleFacts:
    schedule: Schedule
    chunks: tuple[tuple[ChunkFacts, ...], ...]
    """Per rank, per chunk."""
    live: tuple[tuple[tuple[int, ...], ...], ...]
    """Per rank, the Pareto-maximal vectors of micro-batches in flight per chunk over the rank's list (the
    rank's peak of any per-chunk weighting is reached at one of them; one chunk: ((in_flight,),))."""

    def of(self, rank: int, chunk: int = 0) -> ChunkFacts:
        return self.chunks[rank][chunk]

    def host_of(self, rank: int) -> dict[ChunkMb, ChunkMb]:
        """Backward (chunk, j) -> the forward (chunk, micro-batch) hosting it, on `rank`."""
        return {(c.chunk, j): f for c in self.chunks[rank] for j, f in c.hosts}

    def hosted_by(self, rank: int) -> dict[ChunkMb, ChunkMb]:
        """Forward (chunk, micro-batch) -> the backward (chunk, j) it hosts, on `rank`."""
        return {f: b for b, f in self.host_of(rank).items()}


def _live_vectors(acts: tuple[Action, ...], v: int) -> tuple[tuple[int, ...], ...]:
    count = [0] * v
    seen: set[tuple[int, ...]] = set()
    rising = False  # a forward ran since the last release: its vector is not yet recorded
    for a in acts:
        if a.kind is F:
            count[a.chunk] += 1
            rising = True
        elif a.kind in (B, W):
            if rising:  # only the vector before a release can be maximal: each forward's dominates the one before
                seen.add(tuple(count))
                rising = False
            count[a.chunk] -= 1
    if rising:
        seen.add(tuple(count))
    if v == 1:
        return (max(seen, default=(0,)),)

    # a vector that dominates another is lexicographically greater: in descending order, each one is maximal
    # unless a maximal vector already kept dominates it (domination is transitive)
    kept: list[tuple[int, ...]] = []
    for x in sorted(seen, reverse=True):
        if not any(all(map(ge, y, x)) for y in kept):  # y >= x in every chunk (the vectors have v entries each)
            kept.append(x)
    return tuple(sorted(kept))


def _rank_facts(acts: tuple[Action, ...], rank: int, v: int, m: int) -> tuple[ChunkFacts, ...]:
    live: list[set[int]] = [set() for _ in range(v)]
    peak = [0] * v
    opened: dict[ChunkMb, int] = {}
    fwd_pos: list[int] = []
    fwd_key: list[ChunkMb] = []
    spans: list[list[tuple[int, int]]] = [[(0, 0)] * m for _ in range(v)]
    hosts: list[list[tuple[int, ChunkMb]]] = [[] for _ in range(v)]
    for i, a in enumerate(acts):
        key = (a.chunk, a.microbatch)
        if a.kind is F:
            live[a.chunk].add(a.microbatch)
            peak[a.chunk] = max(peak[a.chunk], len(live[a.chunk]))
            opened[key] = i
            fwd_pos.append(i)
            fwd_key.append(key)
            continue
        if a.kind in (B, I):
            start = opened.get(key, i)
            lo = bisect.bisect_right(fwd_pos, start)  # forwards strictly after F(j), all before this action
            spans[a.chunk][a.microbatch] = (lo, len(fwd_key))
            prev = acts[i - 1] if i > 0 else None
            if prev is not None and prev.kind is F and (prev.chunk, prev.microbatch) != key:
                hosts[a.chunk].append((a.microbatch, (prev.chunk, prev.microbatch)))
        if a.kind in (B, W):
            live[a.chunk].discard(a.microbatch)
    forwards = tuple(fwd_key)
    return tuple(ChunkFacts.of_spans(rank, c, m, peak[c], forwards, tuple(spans[c]), tuple(hosts[c])) for c in range(v))


def derive_facts(sched: Schedule) -> ScheduleFacts:
    """Facts of a (validated) schedule."""
    m, v = sched.num_microbatches, sched.num_chunks
    return ScheduleFacts(sched, tuple(_rank_facts(acts, r, v, m) for r, acts in enumerate(sched)),
                         tuple(_live_vectors(acts, v) for acts in sched))
