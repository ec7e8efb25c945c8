"""Lynx's four recomputation windows of one layer, split into what the tensor-parallel collectives and what
context parallelism's exchange contribute (issue 21): `lynx graph` prints them, the Gantt chart draws the CP
part. The windows are the ones Lynx-HEU's eq. (5) caps read (`policy.heu_objective.window_caps`, through
`lynx.cost.pricing`): a block's forward window is its collectives' forward time, its backward window their exposed
backward time, so the CP exchange (a comm op of the attention block, priced by `costmodel._cp_ring_overlap` as
what the ring's attention steps do not hide) is part of the attention windows with nothing added here.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from lynx.graph import Block, LayerGraph, Op

CP_PREFIX = "cp_"
"""The families name every context-parallel collective `cp_*` (`families.base.cp_flash_attention`)."""


def is_cp_op(o: Op) -> bool:
    return o.is_comm and o.name.startswith(CP_PREFIX)


@dataclass(frozen=True, slots=True)
class Window:
    """One of Lynx's windows (phases 1-4 of design.md) and where its idle time comes from."""

    phase: int
    block: Block
    backward: bool
    parts: tuple[tuple[str, float], ...]
    """(collective, seconds of idle compute it offers), forward order."""

    @property
    def total_s(self) -> float:
        return sum(t for _, t in self.parts)

    @property
    def cp_s(self) -> float:
        return sum(t for n, t in self.parts if n.startswith(CP_PREFIX))

    @property
    def tp_s(self) -> float:
        return self.total_s - self.cp_s

    @property
    def label(self) -> str:
        return f"{self.phase}: {self.block} {'backward' if self.backward else 'forward'}"


_PHASES: tuple[tuple[int, Block, bool], ...] = ((1, "attn", False), (2, "mlp", False), (3, "mlp", True),
                                               (4, "attn", True))


def layer_windows(graph: LayerGraph, subtract_wgrad: bool = True) -> tuple[Window, ...]:
    """Phases 1 (attention forward), 2 (MLP forward), 3 (MLP backward), 4 (attention backward), each split by
    collective; totals equal `LayerGraph.fwd_window` / `bwd_window`."""
    return tuple(Window(phase, block, bwd, tuple((o.name, graph.exposed_bwd_time(o, subtract_wgrad) if bwd
                                                  else o.fwd_time) for o in graph.comm_ops(block)))
                 for phase, block, bwd in _PHASES)


def windows_table(graph: LayerGraph, subtract_wgrad: bool = True) -> Table:
    """`lynx graph`'s second table: each window's idle time, its TP and CP parts, and the collectives in it."""
    t = Table(title="recomputation windows of one layer (Lynx phases 1-4; backward: what no GEMM hides)",
              title_justify="left")
    for col in ("window", "idle (ms)", "TP collectives (ms)", "CP exchange (ms)", "collectives"):
        t.add_column(col, justify="left" if col in ("window", "collectives") else "right")
    for w in layer_windows(graph, subtract_wgrad):
        t.add_row(w.label, f"{w.total_s * 1e3:.3f}", f"{w.tp_s * 1e3:.3f}",
                  f"{w.cp_s * 1e3:.3f}" if any(n.startswith(CP_PREFIX) for n, _ in w.parts) else "-",
                  ", ".join(f"{n} {s * 1e3:.3f}" for n, s in w.parts) or "none")
    return t


def cp_exposure(graph: LayerGraph, subtract_wgrad: bool = True) -> tuple[float, float]:
    """Seconds per layer the CP exchange leaves the compute units idle (forward, backward): the CP share of
    windows 1 and 4 (and of any other block, though the families put CP collectives in attention only)."""
    ws = layer_windows(graph, subtract_wgrad)
    return sum(w.cp_s for w in ws if not w.backward), sum(w.cp_s for w in ws if w.backward)


def cp_offset(graph: LayerGraph, backward: bool) -> float:
    """Where the CP exchange starts inside one layer's forward (backward: inside its backward, which runs the
    ops in reverse), as a fraction of the layer's time: for drawing only."""
    ops = list(graph.ops) if not backward else list(reversed(graph.ops))
    times = [o.bwd_time if backward else o.fwd_time for o in ops]
    total = sum(times)
    if total <= 0:
        return 0.0
    t = 0.0
    for o, dt in zip(ops, times, strict=True):
        if is_cp_op(o):
            return t / total
        t += dt
    return 0.0


__all__ = ["CP_PREFIX", "Window", "cp_exposure", "cp_offset", "is_cp_op", "layer_windows", "windows_table"]
