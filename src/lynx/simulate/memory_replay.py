"""Event-by-event memory of one stage (a rank, with all its chunks), from `lynx.memory.layer_memory`:
the same per-layer terms the closed form and the solvers use, replayed action by action."""

from __future__ import annotations

from lynx.graph import LayerGraph
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
        mems = [layer_memory(graph, lp) for lp in pol.layers]
        full_needed = graph.retained_bytes(graph.needed())
        self.chunks: list[list[LayerMemory]] = []
        self.uniform: list[list[float]] = []  # per layer: bytes of a uniform chunk rerun topped there
        for lo, hi in ctx.chunk_slices():
            self.chunks.append(mems[lo:hi])
            run, tops = 0, []
            for i, lp in enumerate(pol.layers[lo:hi]):
                run = run + 1 if (i > 0 and not lp.input_checkpoint) else 1
                tops.append(run)
            self.uniform.append([
                t * full_needed if t > 1 and (i == len(tops) - 1 or tops[i + 1] <= 1) else 0.0
                for i, t in enumerate(tops)])
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
        guest = self.chunks[hosted] if hosted is not None else []
        n = len(mems)
        if chunk == 0:
            self.cur += self.ctx.extra_retained_bytes
        for i, m in enumerate(mems):
            if i < len(guest):
                self.cur += guest[i].fwd_window
            self.cur += m.retained  # alive while the layer runs, together with what it drops
            self._touch((i + 1) / n, m.dropped)
        self.cur += sum(g.fwd_window for g in guest[n:])
        self._touch(1.0, self.ctx.extra_transient_bytes if chunk == self.last_chunk else 0.0)

    def _backward_events(self, chunk: int, carried: bool, prefetched: bool) -> None:
        mems, uniform = self.chunks[chunk], self.uniform[chunk]
        transient = self.ctx.extra_transient_bytes if chunk == self.last_chunk else 0.0
        n = len(mems)
        if prefetched:
            self.cur += sum(m.fwd_window for m in mems)
        pending_bwd_window = 0.0
        self._touch(0.0, transient + self.ctx.grad_workspace_bytes)
        for i in range(n - 1, -1, -1):
            m = mems[i]
            own = m.on_demand + (m.bwd_window if i == n - 1 else 0.0)
            if not (carried or prefetched):
                own += m.fwd_window
            if uniform[i]:
                own += uniform[i]  # a uniform chunk rerun with everything stored
            self.cur += own
            below = mems[i - 1].bwd_window if i > 0 else 0.0
            self.cur += below
            self._touch(1.0 - i / n, self.ctx.grad_workspace_bytes)
            self.cur -= m.retained + own + pending_bwd_window
            if carried or prefetched:
                self.cur -= m.fwd_window
            pending_bwd_window = below
        if chunk == 0:
            self.cur -= self.ctx.extra_retained_bytes
        self._touch(1.0)
