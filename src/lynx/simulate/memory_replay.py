"""Event-by-event memory of one stage (a rank, with all its chunks), from `lynx.cost.memory.layer_memory`:
the same per-layer terms the closed form and the solvers use, replayed action by action.

An action of one kind (forward of chunk c hosting chunk h's phase-1/2 work; backward of chunk c, carried or
prefetched or neither) changes memory the same way every time: a *pattern* (points on a unit time axis
relative to the action's start memory, net change, top). The patterns depend only on the graph, the stage's
layer policies, its chunk split and its non-layer terms, so they are kept per such key across simulations
(`_MODELS`): the partition refinement and the configuration search simulate the same stage again and again.
"""

from __future__ import annotations

from collections import OrderedDict

from lynx.cost.lifetime import BackwardTrace, backward_trace
from lynx.cost.memory import LayerMemory, layer_memories
from lynx.decisions import LayerPolicy, RecomputePolicy, StageContext
from lynx.graph import Graphs, graphs_key, same_graphs, slice_graphs

Pattern = tuple[tuple[tuple[float, float], ...], float, float]
"""(points relative to the action's start memory on a unit time axis, net change, top)."""
PatternKey = tuple[object, ...]


class StageModel:
    """What a stage's memory replay reads, and the patterns derived from it (shared across simulations)."""

    def __init__(self, graph: Graphs, layers: tuple[LayerPolicy, ...], slices: tuple[tuple[int, int], ...],
                 extra_retained: float, extra_transient: float, grad_workspace: float) -> None:
        self.extra_retained, self.extra_transient, self.grad_workspace = extra_retained, extra_transient, grad_workspace
        # a stage repeats one policy (per layer kind): priced once per distinct pair, without hashing the graphs
        mems = layer_memories(graph, layers)
        self.chunks: list[list[LayerMemory]] = []
        self.traces: list[dict[bool, BackwardTrace]] = []
        """Per chunk: the activation-lifetime replay of one backward, phase-1/2 tensors held before or not."""
        for lo, hi in slices:
            self.chunks.append(mems[lo:hi])
            part = slice_graphs(graph, lo, hi)
            self.traces.append({w: backward_trace(part, layers[lo:hi], w) for w in (False, True)})
        self.last_chunk = len(self.chunks) - 1
        self.patterns: dict[PatternKey, Pattern] = {}

    def pattern(self, key: PatternKey) -> Pattern:
        hit = self.patterns.get(key)
        if hit is None:
            points: list[tuple[float, float]] = []
            if key[0] == "F":
                cur = self._forward_events(points, key[1], key[2])  # type: ignore[arg-type]
            else:
                cur = self._backward_events(points, key[1], key[2], key[3])  # type: ignore[arg-type]
            hit = (tuple(points), cur, max(v for _, v in points))
            self.patterns[key] = hit
        return hit

    def _forward_events(self, points: list[tuple[float, float]], chunk: int, hosted: int | None) -> float:
        mems = self.chunks[chunk]
        guest = self.traces[hosted][True].fwd_held if hosted is not None else ()
        n = len(mems)
        cur = 0.0
        if chunk == 0:
            cur += self.extra_retained
        for i, m in enumerate(mems):
            if i < len(guest):
                cur += guest[i]
            cur += m.retained  # alive while the layer runs, together with what it drops
            points.append(((i + 1) / n, cur + m.dropped))
        cur += sum(guest[n:])
        points.append((1.0, cur + (self.extra_transient if chunk == self.last_chunk else 0.0)))
        off = sum(m.offloaded for m in mems)
        if off:  # copied out behind the following work (docs/offload.md): off the device until the reload
            cur -= off
            points.append((1.0, cur))
        return cur

    def _backward_events(self, points: list[tuple[float, float]], chunk: int, carried: bool,
                         prefetched: bool) -> float:
        mems, held = self.chunks[chunk], carried or prefetched
        tr = self.traces[chunk][held]
        transient = self.extra_transient if chunk == self.last_chunk else 0.0
        n = len(mems)
        cur = 0.0
        if prefetched:
            cur += sum(tr.fwd_held)
        cur += sum(m.offloaded for m in mems)  # reloaded before the backward (docs/offload.md)
        start = cur
        points.append((0.0, cur + (transient + self.grad_workspace)))
        for i in range(n - 1, -1, -1):  # layer i's backward: what the lifetime replay has alive at its peak
            cur = start + tr.layer_peak[i]
            points.append((1.0 - i / n, cur + self.grad_workspace))
        cur = start - sum(m.retained for m in mems) - (sum(tr.fwd_held) if held else 0.0)
        if chunk == 0:
            cur -= self.extra_retained
        points.append((1.0, cur + 0.0))
        return cur


_MODELS: OrderedDict[PatternKey, tuple[Graphs, StageModel]] = OrderedDict()
MODEL_CACHE_SIZE = 2048


def stage_model(graph: Graphs, pol: RecomputePolicy, ctx: StageContext) -> StageModel:
    """The stage's memory model, memoized per graph object, layer policies, chunk split and non-layer terms
    (exactly what the replay reads)."""
    slices = ctx.chunk_slices()
    key = (graphs_key(graph), pol.layers, slices, ctx.extra_retained_bytes, ctx.extra_transient_bytes,
           ctx.grad_workspace_bytes)
    hit = _MODELS.get(key)
    if hit is not None and same_graphs(hit[0], graph):
        _MODELS.move_to_end(key)
        return hit[1]
    model = StageModel(graph, pol.layers, slices, ctx.extra_retained_bytes, ctx.extra_transient_bytes,
                       ctx.grad_workspace_bytes)
    _MODELS[key] = (graph, model)
    if len(_MODELS) > MODEL_CACHE_SIZE:
        _MODELS.popitem(last=False)
    return model


class StageMemory:
    """Memory of one stage over an iteration; actions of one kind change it the same way every time."""

    def __init__(self, graph: Graphs, pol: RecomputePolicy, ctx: StageContext, record: bool = True) -> None:
        self.ctx, self.record = ctx, record
        self.model = stage_model(graph, pol, ctx)
        self.chunks = self.model.chunks
        self.last_chunk = self.model.last_chunk
        self.cur = ctx.static_bytes
        self.peak = self.cur + ctx.step_bytes  # the optimizer step's own allocation, when no activation is alive
        self.curve: list[tuple[float, float]] = [(0.0, self.cur)]

    def _replay(self, key: PatternKey, t0: float, t1: float) -> None:
        points, delta, top = self.model.pattern(key)
        base = self.cur
        self.peak = max(self.peak, base + top)
        if self.record:
            self.curve.extend((t0 + (t1 - t0) * f, base + v) for f, v in points)
        self.cur = base + delta

    def forward(self, t0: float, t1: float, chunk: int, hosted: int | None) -> None:
        """`hosted`: the chunk whose phase-1/2 tensors this forward recomputes in its windows (held on)."""
        self._replay(("F", chunk, hosted), t0, t1)

    def backward(self, t0: float, t1: float, chunk: int, carried: bool, prefetched: bool) -> None:
        """`carried`: phase-1/2 tensors were recomputed in an earlier forward (already held);
        `prefetched`: they were recomputed in the stall before this backward."""
        self._replay(("B", chunk, carried, prefetched), t0, t1)
