"""The event loop: interpret any valid action list. Each rank runs its actions in order; an action starts
when its rank is free and its cross-stage input has arrived (forward: the previous virtual stage's
forward plus a point-to-point transfer; backward: the next virtual stage's backward plus a transfer, or
its own forward on the last virtual stage)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from lynx.cost.layer import EdgeTimes
from lynx.cost.stage import ChunkCosts, charge_stage
from lynx.decisions import RecomputePolicy, StageContext, check_policy
from lynx.graph import Graphs, graphs_key, same_graphs
from lynx.schedule import ActionKind, Schedule, ScheduleError, ScheduleFacts
from lynx.simulate.memory_replay import StageMemory
from lynx.simulate.results import Segment, SegmentKind

Key = tuple[int, int]
"""(virtual stage, micro-batch)."""


@dataclass
class RankState:
    costs: list[ChunkCosts]
    ctx: StageContext
    policy: RecomputePolicy
    memory: StageMemory | None
    """None: times only (`simulate.simulate_time`); the loop then keeps no memory."""
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
SCHEDULE_MEMO_SIZE = 256
"""Schedules remembered by the loop's memos (as many as `problem._facts` keeps: the configuration search visits a
few hundred (PP, micro-batches, VPP) and returns to them out of order)."""


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
    if len(_STEPS) >= SCHEDULE_MEMO_SIZE:
        _STEPS.clear()
    _STEPS[id(sched)] = (sched, steps)
    return steps


_PRICED: dict[tuple[object, ...], tuple[Graphs, list[ChunkCosts]]] = {}
_CHECKED: dict[tuple[object, ...], Graphs] = {}
MEMO_SIZE = 4096


def priced(graph: Graphs, pol: RecomputePolicy, ctx: StageContext, edges: EdgeTimes | None = None,
           copy_exposed: float = 0.0) -> list[ChunkCosts]:
    """`cost.stage.charge_stage`, memoized per graph object and the whole policy, context, edges and copies
    (whatever of them the pricing reads); each call gets fresh copies, which the caller may add to."""
    key = (graphs_key(graph), pol, ctx, edges, copy_exposed)
    hit = _PRICED.get(key)
    if hit is None or not same_graphs(hit[0], graph):
        if len(_PRICED) >= MEMO_SIZE:
            _PRICED.clear()
        hit = (graph, charge_stage(graph, pol, ctx, edges, copy_exposed))
        _PRICED[key] = hit
    return [replace(c, fwd_loads=list(c.fwd_loads), _carry=dict(c._carry)) for c in hit[1]]


def checked(graph: Graphs, pol: RecomputePolicy, ctx: StageContext) -> None:
    """`check_policy`, remembered per graph object, policy and context once it has passed."""
    key = (graphs_key(graph), pol, ctx)
    hit = _CHECKED.get(key)
    if hit is not None and same_graphs(hit, graph):
        return
    check_policy(graph, pol, ctx)
    if len(_CHECKED) >= MEMO_SIZE:
        _CHECKED.clear()
    _CHECKED[key] = graph


_HOSTS: dict[int, tuple[ScheduleFacts, list[tuple[dict[Key, Key], dict[Key, Key]]]]] = {}


def hosts(facts: ScheduleFacts, rank: int) -> tuple[dict[Key, Key], dict[Key, Key]]:
    """`facts.host_of(rank)` and `facts.hosted_by(rank)`, built once per facts object (thousands of
    micro-batch pairs on a deep pipeline; the simulator only reads them)."""
    hit = _HOSTS.get(id(facts))
    if hit is None or hit[0] is not facts:
        hit = (facts, [(facts.host_of(r), facts.hosted_by(r)) for r in range(len(facts.chunks))])
        if len(_HOSTS) >= SCHEDULE_MEMO_SIZE:
            _HOSTS.clear()
        _HOSTS[id(facts)] = hit
    return hit[1][rank]


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
            extra, hidden = st.costs[guest[0]].carried(chunk_layer_count(st.ctx, chunk))
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
        if st.memory is not None:
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
        if st.memory is not None:
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
        if not self.record:
            self._run_compiled()
            return
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

    def _run_compiled(self) -> None:
        """The same loop without recording: the actions in a dependency order fixed per schedule
        (`_compiled`), each rank's per-action prices and memory patterns looked up once, and the same
        floating-point operations in the same order per rank as `step`, so every figure is identical."""
        comp = _compiled(self.facts)
        p2p = self.p2p_s
        ranks = self.ranks
        pp = len(ranks)
        ends = [0.0] * comp.size
        ready = [st.ready for st in ranks]
        busy = [st.busy for st in ranks]
        crit = [st.crit for st in ranks]
        hidden = [st.hidden for st in ranks]
        mem = all(st.memory is not None for st in ranks)  # else times only: no memory kept
        cur = [st.memory.cur if st.memory is not None else 0.0 for st in ranks]
        peak = [st.memory.peak if st.memory is not None else 0.0 for st in ranks]
        fwd_price: list[dict[int, tuple[float, bool, float, float, float, float]]] = [{} for _ in range(pp)]
        bwd_price: list[list[tuple[float, float, float, float]]] = []
        cooldown = [st.policy.cooldown_overlap for st in ranks]
        for st in ranks:
            bwd_price.append([(c.bwd_base, c.bwd_ondemand, c.bwd_hidden,
                               c.fwd_phase_load if st.fwd_windows else 0.0) for c in st.costs])
        bwd_mem: list[dict[tuple[int, bool, bool], tuple[float, float]]] = [{} for _ in range(pp)]
        for r, fwd, chunk, depi, selfi, aux, p2p_dep in comp.order:
            rd = ready[r]
            if fwd:
                dep = ends[depi] + p2p if depi >= 0 else 0.0
                start = dep if dep > rd else rd  # max(rd, dep), without the call
                key = chunk * 1024 + aux
                fp = fwd_price[r].get(key)
                if fp is None:
                    fp = self._fwd_price(r, chunk, aux, mem)
                    fwd_price[r][key] = fp
                plain, guest, extra, hid, delta, top = fp
                if guest:
                    end = start + (plain + extra)
                    hidden[r] += hid
                    crit[r] += extra
                else:
                    end = start + plain
            else:
                dep = ends[depi] + p2p if p2p_dep else ends[depi]
                base, ondemand, bhid, load = bwd_price[r][chunk]
                pre, prefetched, extra = 0.0, False, 0.0
                if not aux and load > 0:
                    stall = dep - rd
                    stall = stall if stall > 0.0 else 0.0
                    if cooldown[r] and stall > 0:
                        pre = stall if stall < load else load
                        prefetched = True
                        hidden[r] += pre
                    extra = load - pre
                start = rd + pre
                start = dep if dep > start else start
                demand = ondemand + extra
                end = start + base + extra
                crit[r] += demand
                hidden[r] += bhid
                if mem:
                    mkey = (chunk, bool(aux), prefetched)
                    mp = bwd_mem[r].get(mkey)
                    if mp is None:
                        memory = ranks[r].memory
                        assert memory is not None
                        _, delta, top = memory.model.pattern(("B", chunk, bool(aux), prefetched))
                        mp = (delta, top)
                        bwd_mem[r][mkey] = mp
                    delta, top = mp
            if mem:
                base_mem = cur[r]
                top += base_mem
                if top > peak[r]:
                    peak[r] = top
                cur[r] = base_mem + delta
            ends[selfi] = end
            busy[r] += end - start
            ready[r] = end
        for r, st in enumerate(ranks):
            st.ready, st.busy, st.crit, st.hidden = ready[r], busy[r], crit[r], hidden[r]
            if st.memory is not None:
                st.memory.cur, st.memory.peak = cur[r], peak[r]
            st.pos = len(self.steps[r])

    def _fwd_price(self, r: int, chunk: int, guest: int, mem: bool = True
                   ) -> tuple[float, bool, float, float, float, float]:
        """(plain forward, hosts a guest, its overflow, its hidden part, memory change, memory top) of a
        forward of `chunk` on rank r hosting chunk `guest`'s phase-1/2 work (-1: none); without `mem` the
        memory change and top are 0 (times only)."""
        st = self.ranks[r]
        c = st.costs[chunk]
        extra = hidden = 0.0
        if guest >= 0:
            extra, hidden = st.costs[guest].carried(chunk_layer_count(st.ctx, chunk))
        delta = top = 0.0
        if mem:
            assert st.memory is not None
            _, delta, top = st.memory.model.pattern(("F", chunk, guest if guest >= 0 else None))
        return c.fwd_plain, guest >= 0, extra, hidden, delta, top


def chunk_layer_count(ctx: StageContext, chunk: int) -> int:
    """Layers of model chunk `chunk` on the stage (the stage's layers with one chunk; the memory replay's chunks
    are these slices, `StageContext.chunk_slices`)."""
    return ctx.chunk_layers[chunk] if ctx.chunk_layers else ctx.num_layers


CompiledStep = tuple[int, bool, int, int, int, int, bool]
"""(rank, is forward, chunk, index of the end time it waits for (-1: none), its own index, forward: the
guest chunk it hosts (-1: none) / backward: 1 when carried, whether a p2p transfer precedes it)."""


@dataclass(frozen=True, slots=True)
class Compiled:
    size: int
    order: tuple[CompiledStep, ...]


_COMPILED: dict[int, tuple[ScheduleFacts, Compiled]] = {}


def _compiled(facts: ScheduleFacts) -> Compiled:
    """The schedule's actions in the order the round-robin loop of `run` takes them, with dependencies as
    indices; once per facts object (it holds the schedule and its hosting pairs)."""
    hit = _COMPILED.get(id(facts))
    if hit is not None and hit[0] is facts:
        return hit[1]
    sched = facts.schedule
    steps = _steps(sched)
    last = sched.num_virtual_stages - 1
    host_of = [hosts(facts, r)[0] for r in range(len(steps))]
    hosted_by = [hosts(facts, r)[1] for r in range(len(steps))]
    index: dict[tuple[bool, int, int], int] = {}
    order: list[CompiledStep] = []
    pos = [0] * len(steps)
    remaining = sum(len(s) for s in steps)
    while remaining:
        progressed = False
        for r, acts in enumerate(steps):
            if pos[r] >= len(acts):
                continue
            fwd, chunk, j, vs = acts[pos[r]]
            if fwd:
                depk = (True, vs - 1, j) if vs > 0 else None
                guest = hosted_by[r].get((chunk, j))
                aux, p2p_dep = (guest[0] if guest is not None else -1), vs > 0
            else:
                depk = (False, vs + 1, j) if vs < last else (True, vs, j)
                aux, p2p_dep = int((chunk, j) in host_of[r]), vs < last
            if depk is not None and depk not in index:
                continue
            index[(fwd, vs, j)] = len(order)
            order.append((r, fwd, chunk, index[depk] if depk is not None else -1, len(order), aux, p2p_dep))
            pos[r] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked at positions " + str(pos))
    comp = Compiled(len(order), tuple(order))
    if len(_COMPILED) >= SCHEDULE_MEMO_SIZE:
        _COMPILED.clear()
    _COMPILED[id(facts)] = (facts, comp)
    return comp
