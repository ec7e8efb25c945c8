"""The event loop: interpret any valid action list. Each rank runs its actions in order; an action starts
when its rank is free and its cross-stage input has arrived (forward: the previous virtual stage's
forward plus a point-to-point transfer; backward: the next virtual stage's backward plus a transfer, or
its own forward on the last virtual stage)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lynx.policy.base import RecomputePolicy, StageContext
from lynx.schedule import ActionKind, Schedule, ScheduleError, ScheduleFacts
from lynx.simulate.memory_replay import StageMemory
from lynx.simulate.pricing import ChunkCosts
from lynx.simulate.results import Segment, SegmentKind

Key = tuple[int, int]
"""(virtual stage, micro-batch)."""


@dataclass
class RankState:
    costs: list[ChunkCosts]
    ctx: StageContext
    policy: RecomputePolicy
    memory: StageMemory
    host_of: dict[Key, Key]
    """Backward (chunk, j) -> the forward (chunk, micro-batch) hosting its phase-1/2 work."""
    hosted_by: dict[Key, Key]
    fwd_windows: bool = False
    ready: float = 0.0
    pos: int = 0
    busy: float = 0.0
    crit: float = 0.0
    hidden: float = 0.0


Step = tuple[bool, int, int, int]
"""(is forward, chunk, micro-batch, virtual stage) of one action, precomputed for the loop."""


_STEPS: dict[int, tuple[Schedule, list[list[Step]]]] = {}


def _steps(sched: Schedule) -> list[list[Step]]:
    """The schedule's actions as loop steps, once per schedule object (the partition refinement and the
    configuration search simulate the same schedule many times); the loop only reads them."""
    hit = _STEPS.get(id(sched))
    if hit is not None and hit[0] is sched:
        return hit[1]
    steps = []
    for acts in sched:
        for a in acts:
            if a.kind is not ActionKind.F and a.kind is not ActionKind.B:
                raise ScheduleError(f"the simulator prices F and B actions; {a.text(sched.pp)} (a split "
                                    "backward, I/W) is not modelled yet")
        steps.append([(a.kind is ActionKind.F, a.chunk, a.microbatch, a.virtual_stage(sched.pp)) for a in acts])
    if len(_STEPS) >= 64:
        _STEPS.clear()
    _STEPS[id(sched)] = (sched, steps)
    return steps


@dataclass
class Loop:
    facts: ScheduleFacts
    ranks: list[RankState]
    p2p_s: float
    record: bool
    f_end: dict[Key, float] = field(default_factory=dict)
    b_end: dict[Key, float] = field(default_factory=dict)
    segments: list[Segment] = field(default_factory=list)
    steps: list[list[Step]] = field(default_factory=list)
    last: int = 0

    def __post_init__(self) -> None:
        sched = self.facts.schedule
        self.last = sched.num_virtual_stages - 1
        self.steps = _steps(sched)

    def _seg(self, r: int, kind: SegmentKind, j: int, t0: float, t1: float, chunk: int) -> None:
        self.segments.append(Segment(r, kind, j, t0, t1, chunk))

    def _forward(self, r: int, st: RankState, chunk: int, j: int, vs: int) -> tuple[float, float] | None:
        c = st.costs[chunk]
        if vs > 0 and (vs - 1, j) not in self.f_end:
            return None
        dep = self.f_end[(vs - 1, j)] + self.p2p_s if vs > 0 else 0.0
        start = max(st.ready, dep)
        guest = st.hosted_by.get((chunk, j))
        extra = hidden = 0.0
        if guest is not None:
            extra, hidden = st.costs[guest[0]].carried(len(st.memory.chunks[chunk]))
        end = start + (c.fwd_plain + extra if guest is not None else c.fwd_plain)
        self.f_end[(vs, j)] = end
        if guest is not None:
            st.hidden += hidden
            st.crit += extra
        if self.record:
            if start > st.ready:
                self._seg(r, SegmentKind.STALL, j, st.ready, start, chunk)
            self._seg(r, SegmentKind.F, j, start, end, chunk)
            if guest is not None and hidden > 0:
                self._seg(r, SegmentKind.OVERLAP, guest[1], start, start + hidden, guest[0])
        st.memory.forward(start, end, chunk, guest[0] if guest is not None else None)
        return start, end

    def _backward(self, r: int, st: RankState, chunk: int, j: int, vs: int) -> tuple[float, float] | None:
        c = st.costs[chunk]
        if vs < self.last and (vs + 1, j) not in self.b_end:
            return None
        dep = self.b_end[(vs + 1, j)] + self.p2p_s if vs < self.last else self.f_end[(vs, j)]
        carried = (chunk, j) in st.host_of
        pre, prefetched, extra = 0.0, False, 0.0
        load = c.fwd_phase_load if st.fwd_windows else 0.0
        if not carried and load > 0:
            stall = max(0.0, dep - st.ready)
            if st.policy.cooldown_overlap and stall > 0:
                pre = min(load, stall)
                prefetched = True
                st.hidden += pre
            extra = load - pre
        start = max(st.ready + pre, dep)
        demand = c.bwd_ondemand + extra
        end = start + c.bwd_base + extra
        st.crit += demand
        st.hidden += c.bwd_hidden
        self.b_end[(vs, j)] = end
        if self.record:
            if pre > 0:
                self._seg(r, SegmentKind.OVERLAP, j, st.ready, st.ready + pre, chunk)
            if start > st.ready + pre:
                self._seg(r, SegmentKind.STALL, j, st.ready + pre, start, chunk)
            if demand > 0:
                self._seg(r, SegmentKind.RECOMPUTE, j, start, start + demand, chunk)
            self._seg(r, SegmentKind.B, j, start + demand, end, chunk)
        st.memory.backward(start, end, chunk, carried, prefetched)
        return start, end

    def step(self, r: int) -> bool:
        """Run rank r's next action if its inputs are ready; False when it must wait."""
        st = self.ranks[r]
        fwd, chunk, j, vs = self.steps[r][st.pos]
        span = self._forward(r, st, chunk, j, vs) if fwd else self._backward(r, st, chunk, j, vs)
        if span is None:
            return False
        st.busy += span[1] - span[0]
        st.ready = span[1]
        st.pos += 1
        return True

    def run(self) -> None:
        lengths = [len(s) for s in self.steps]
        remaining = sum(lengths)
        while remaining:
            progressed = False
            for r, n in enumerate(lengths):
                if self.ranks[r].pos < n and self.step(r):
                    remaining -= 1
                    progressed = True
            if not progressed:  # cannot happen for a validated schedule; guard against a hang
                raise RuntimeError("pipeline schedule deadlocked at positions " + str([s.pos for s in self.ranks]))
