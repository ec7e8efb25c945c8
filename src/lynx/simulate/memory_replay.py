"""Event-by-event memory of one stage (a rank, with all its chunks), from `lynx.memory.layer_memory`:
the same per-layer terms the closed form and the solvers use, replayed action by action."""

from __future__ import annotations

from lynx.graph import LayerGraph
from lynx.lifetime import BackwardTrace, backward_trace
from lynx.memory import LayerMemory, layer_memory
from lynx.policy.base import RecomputePolicy, StageContext

Pattern = tuple[tuple[tuple[float, float], ...], float, float]
"""(points relative to the action's start memory on a unit time axis, net change, top)."""


class StageMemory:
    """Memory of one stage over an iteration; actions of one kind change it the same way every time."""

    def __init__(self, graph: LayerGraph, pol: RecomputePolicy, ctx: StageContext, record: bool = True) -> None:
        self.ctx, self.record = ctx, record
        self._patterns: dict[tuple[object, ...], Pattern] = {}
        self._points: list[tuple[float, float]] = []
        distinct = {lp: layer_memory(graph, lp) for lp in dict.fromkeys(pol.layers)}  # a stage repeats one policy
        mems = [distinct[lp] for lp in pol.layers]
        self.chunks: list[list[LayerMemory]] = []
        self.traces: list[dict[bool, BackwardTrace]] = []
        """Per chunk: the activation-lifetime replay of one backward, phase-1/2 tensors held before or not."""
        for lo, hi in ctx.chunk_slices():
            self.chunks.append(mems[lo:hi])
            self.traces.append({w: backward_trace(graph, pol.layers[lo:hi], w) for w in (False, True)})
        self.last_chunk = len(self.chunks) - 1
        self.cur = ctx.static_bytes
        self.peak = self.cur
        self.curve: list[tuple[float, float]] = [(0.0, self.cur)]

    def _touch(self, t: float, transient: float = 0.0) -> None:
        self._points.append((t, self.cur + transient))

    def _replay(self, key: tuple[object, ...], t0: float, t1: float) -> None:
        pattern = self._patterns.get(key)
        if pattern is None:
            saved = self.cur
            self.cur, self._points = 0.0, []
            if key[0] == "F":
                self._forward_events(key[1], key[2])  # type: ignore[arg-type]
            else:
                self._backward_events(key[1], key[2], key[3])  # type: ignore[arg-type]
            pattern = (tuple(self._points), self.cur, max(v for _, v in self._points))
            self._patterns[key] = pattern
            self.cur = saved
        points, delta, top = pattern
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

    def _forward_events(self, chunk: int, hosted: int | None) -> None:
        mems = self.chunks[chunk]
        guest = self.traces[hosted][True].fwd_held if hosted is not None else ()
        n = len(mems)
        if chunk == 0:
            self.cur += self.ctx.extra_retained_bytes
        for i, m in enumerate(mems):
            if i < len(guest):
                self.cur += guest[i]
            self.cur += m.retained  # alive while the layer runs, together with what it drops
            self._touch((i + 1) / n, m.dropped)
        self.cur += sum(guest[n:])
        self._touch(1.0, self.ctx.extra_transient_bytes if chunk == self.last_chunk else 0.0)
        off = sum(m.offloaded for m in mems)
        if off:  # copied out behind the following work (docs/offload.md): off the device until the reload
            self.cur -= off
            self._touch(1.0)

    def _backward_events(self, chunk: int, carried: bool, prefetched: bool) -> None:
        mems, held = self.chunks[chunk], carried or prefetched
        tr = self.traces[chunk][held]
        transient = self.ctx.extra_transient_bytes if chunk == self.last_chunk else 0.0
        n = len(mems)
        if prefetched:
            self.cur += sum(tr.fwd_held)
        self.cur += sum(m.offloaded for m in mems)  # reloaded before the backward (docs/offload.md)
        start = self.cur
        self._touch(0.0, transient + self.ctx.grad_workspace_bytes)
        for i in range(n - 1, -1, -1):  # layer i's backward: what the lifetime replay has alive at its peak
            self.cur = start + tr.layer_peak[i]
            self._touch(1.0 - i / n, self.ctx.grad_workspace_bytes)
        self.cur = start - sum(m.retained for m in mems) - (sum(tr.fwd_held) if held else 0.0)
        if chunk == 0:
            self.cur -= self.ctx.extra_retained_bytes
        self._touch(1.0)
