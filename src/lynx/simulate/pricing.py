"""Pricing: what each action of a stage costs, from the layer graph and the stage's policy.

* F = the chunk's layers' forward ops, forward collectives blocking (Megatron TP), plus any overflow of
  recomputation that a plan put in a forward window beyond the window's idle time.
* B = backward compute + exposed backward collectives (comm - wgrad) + on-demand recomputation (phase 5,
  each chunk's top layer's phases 3/4, and window overflow).
A forward that hosts a backward's phase-1/2 work lends its layers' windows, layer by layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lynx.graph import LayerGraph
from lynx.policy.base import FWD_PHASES, LayerPolicy, Phase, RecomputePolicy, StageContext
from lynx.pricing import bwd_windows, fwd_windows, ops_recompute_cost


def recompute_time(graph: LayerGraph, lp: LayerPolicy, phases: tuple[Phase, ...]) -> float:
    """The recomputation of these phases, at the one price list (`lynx.pricing`); on demand also the kept
    ops a Megatron checkpoint re-runs (`LayerPolicy.rerun`)."""
    rerun = ops_recompute_cost(graph, sorted(lp.rerun)) if Phase.ON_DEMAND in phases else 0.0
    return ops_recompute_cost(graph, lp.recomputed(phases)) + rerun


@dataclass(frozen=True, slots=True)
class LayerCost:
    fwd: float                   # forward with blocking collectives
    bwd: float                   # backward with exposed collectives
    win_f: tuple[float, float]   # idle time of the attention / MLP forward collectives
    win_b: tuple[float, float]   # idle time of the MLP / attention backward collectives (phase 3, 4 order)


def layer_cost(graph: LayerGraph, subtract_wgrad: bool) -> LayerCost:
    compute_bwd = sum(o.bwd_time for o in graph.ops if not o.is_comm)
    exposed = graph.bwd_window("attn", subtract_wgrad) + graph.bwd_window("mlp", subtract_wgrad)
    return LayerCost(
        fwd=graph.fwd_time(),
        bwd=compute_bwd + exposed,
        win_f=fwd_windows(graph),
        win_b=bwd_windows(graph, subtract_wgrad),
    )


@dataclass
class ChunkCosts:
    """Per-action times of one model chunk of a stage, split into what is critical and what is hidden."""

    fwd_plain: float = 0.0
    bwd_base: float = 0.0             # backward incl. phase 5, top layer's 3/4, backward-window overflow
    bwd_hidden: float = 0.0           # hidden in backward windows
    bwd_ondemand: float = 0.0         # the on-demand part of bwd_base
    fwd_phase_load: float = 0.0       # phase-1/2 recomputation of one micro-batch (for cool-down)
    fwd_loads: list[tuple[float, float]] = field(default_factory=list)
    """Per layer, its phase-1 and phase-2 recomputation time."""
    win_f: tuple[float, float] = (0.0, 0.0)
    copy_exposed: float = 0.0
    """Offload copies this chunk's backward waits for (`lynx.simulate.copies`; part of bwd_base)."""
    _carry: dict[int, tuple[float, float]] = field(default_factory=dict)

    def carried(self, host_layers: int) -> tuple[float, float]:
        """(overflow onto the host forward, hidden in its windows) when a forward with `host_layers`
        layers hosts this chunk's phase-1/2 work: layer i in the host's layer i, the rest on demand."""
        if host_layers not in self._carry:
            extra = hidden = 0.0
            for i, loads in enumerate(self.fwd_loads):
                for k, load in enumerate(loads):
                    win = self.win_f[k] if i < host_layers else 0.0
                    hidden += min(load, win)
                    extra += max(0.0, load - win)
            self._carry[host_layers] = (extra, hidden)
        return self._carry[host_layers]


def chunk_costs(graph: LayerGraph, layers: tuple[LayerPolicy, ...], lc: LayerCost) -> ChunkCosts:
    c = ChunkCosts(win_f=lc.win_f)
    n = len(layers)
    for i, lp in enumerate(layers):
        c.fwd_plain += lc.fwd
        c.bwd_base += lc.bwd
        demand = recompute_time(graph, lp, (Phase.ON_DEMAND,))
        loads = tuple(recompute_time(graph, lp, (ph,)) for ph in FWD_PHASES)
        c.fwd_loads.append((loads[0], loads[1]))
        for load in loads:
            c.fwd_phase_load += load
        for k, ph in enumerate((Phase.BWD_MLP, Phase.BWD_ATTN)):
            load = recompute_time(graph, lp, (ph,))
            if i == n - 1:  # the top layer has no layer above whose backward windows it could use
                demand += load
            else:
                c.bwd_hidden += min(load, lc.win_b[k])
                demand += max(0.0, load - lc.win_b[k])
        c.bwd_base += demand
        c.bwd_ondemand += demand
    return c


def stage_costs(graph: LayerGraph, pol: RecomputePolicy, ctx: StageContext) -> list[ChunkCosts]:
    """One ChunkCosts per model chunk of the stage (one without interleaving)."""
    lc = layer_cost(graph, ctx.subtract_wgrad)
    return [chunk_costs(graph, pol.layers[lo:hi], lc) for lo, hi in ctx.chunk_slices()]
