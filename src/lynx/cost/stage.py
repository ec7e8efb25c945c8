"""Charging a stage: what each action of a pipeline stage costs, from the layer graph and the stage's policy
(`charge_stage`, the one function the simulator prices a stage with).

* F = the chunk's layers' forward ops, forward collectives blocking (Megatron TP), plus any overflow of
  recomputation that a plan put in a forward window beyond the window's idle time.
* B = backward compute + exposed backward collectives (comm - wgrad) + on-demand recomputation (phase 5,
  each chunk's top layer's phases 3/4, and window overflow).
A forward that hosts a backward's phase-1/2 work lends its layers' windows, layer by layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lynx.cost.layer import EdgeTimes
from lynx.cost.pricing import LayerRecompute, bwd_windows, fsdp_window, fwd_windows, layer_recompute
from lynx.decisions import FsdpCharge, LayerPolicy, RecomputePolicy, StageContext
from lynx.graph import Graphs, LayerGraph, per_layer


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
    win_fs: list[tuple[float, float]] = field(default_factory=list)
    """Per layer, its forward windows where the chunk's layers differ in kind (empty: `win_f` for every layer):
    a host forward's layer i lends the windows of a layer of layer i's kind."""
    copy_exposed: float = 0.0
    """Offload copies this chunk's backward waits for (part of bwd_base; `charge_stage`)."""
    _carry: dict[int, tuple[float, float]] = field(default_factory=dict)

    def carried(self, host_layers: int) -> tuple[float, float]:
        """(overflow onto the host forward, hidden in its windows) when a forward with `host_layers`
        layers hosts this chunk's phase-1/2 work: layer i in the host's layer i, the rest on demand."""
        if host_layers not in self._carry:
            extra = hidden = 0.0
            for i, loads in enumerate(self.fwd_loads):
                wf = self.win_fs[i] if self.win_fs else self.win_f
                for k, load in enumerate(loads):
                    win = wf[k] if i < host_layers else 0.0
                    hidden += min(load, win)
                    extra += max(0.0, load - win)
            self._carry[host_layers] = (extra, hidden)
        return self._carry[host_layers]


def chunk_costs(graph: Graphs, layers: tuple[LayerPolicy, ...], lc: LayerCost | tuple[LayerCost, ...],
                fsdp: FsdpCharge | None = None, fsdp_win: float | tuple[float, ...] = 0.0) -> ChunkCosts:
    """One chunk's layers. `lc`: one layer cost for every layer, or one per layer (layers of several kinds); a
    layer's phase-3/4 work hides in the backward windows of the layer above it. Under FSDP (`fsdp`) a forward step
    lasts max(forward, the next layer's gather), a backward step max(backward + on-demand recomputation, gather +
    reduce-scatter): the window `fsdp_win` (`pricing.fsdp_window`, one or one per layer) is charged as exposed
    time and hosts the layer's on-demand recomputation; each micro-batch's forward waits for its first gather and
    its backward for its last reduction."""
    n = len(layers)
    gs = per_layer(graph, n)
    lcs = (lc,) * n if isinstance(lc, LayerCost) else lc
    wins = (fsdp_win,) * n if isinstance(fsdp_win, float) else fsdp_win
    c = ChunkCosts(win_f=lcs[0].win_f if lcs else (0.0, 0.0))
    if any(x is not lcs[0] for x in lcs):
        c.win_fs = [x.win_f for x in lcs]
    if fsdp is not None and n:
        c.fwd_plain += fsdp.start_s
        c.bwd_base += fsdp.end_s
    seen: dict[tuple[int, int, tuple[float, float], bool, float], LayerRecompute] = {}
    for i, lp in enumerate(layers):
        fwd_exposed = max(0.0, fsdp.gather_fwd_s - lcs[i].fwd) if fsdp is not None else 0.0
        c.fwd_plain += lcs[i].fwd + fwd_exposed
        c.bwd_base += lcs[i].bwd + wins[i]
        win_b = lcs[i + 1].win_b if i + 1 < n else lcs[i].win_b
        key = (id(gs[i]), id(lp), win_b, i == n - 1, wins[i])  # a chunk repeats a few (graph, policy) objects
        r = seen.get(key)
        if r is None:
            r = seen[key] = layer_recompute(gs[i], lp, win_b, top=i == n - 1, fsdp_win=wins[i])
        c.fwd_loads.append(r.fwd_loads)
        for load in r.fwd_loads:
            c.fwd_phase_load += load
        c.bwd_hidden += r.bwd_hidden
        c.bwd_base += r.on_demand
        c.bwd_ondemand += r.on_demand
    return c


def stage_costs(graph: Graphs, pol: RecomputePolicy, ctx: StageContext) -> list[ChunkCosts]:
    """One ChunkCosts per model chunk of the stage (one without interleaving)."""
    if isinstance(graph, LayerGraph):
        lc = layer_cost(graph, ctx.subtract_wgrad)
        win = fsdp_window(graph, ctx)
        return [chunk_costs(graph, pol.layers[lo:hi], lc, ctx.fsdp, win) for lo, hi in ctx.chunk_slices()]
    by_graph = {id(g): (layer_cost(g, ctx.subtract_wgrad), fsdp_window(g, ctx)) for g in graph}
    per = tuple(by_graph[id(g)] for g in per_layer(graph, len(pol.layers)))
    lcs, wins = tuple(x[0] for x in per), tuple(x[1] for x in per)
    return [chunk_costs(graph[lo:hi], pol.layers[lo:hi], lcs[lo:hi], ctx.fsdp, wins[lo:hi])
            for lo, hi in ctx.chunk_slices()]


def charge_stage(graph: Graphs, pol: RecomputePolicy, ctx: StageContext, edges: EdgeTimes | None = None,
                 copy_exposed: float = 0.0) -> list[ChunkCosts]:
    """Everything one pipeline stage's actions cost per micro-batch, chunk by chunk: its layers' forward and
    backward with the recomputation its policy places (`chunk_costs`), the offload copies its backwards wait for
    (`copy_exposed` per micro-batch, `policy.offload.stage_exposed_copy`, split evenly over its chunks, each of
    which runs one backward per micro-batch), and on the first and last stage the embedding and the LM head with
    its loss (`edges`: first virtual stage and last virtual stage, as Megatron places them)."""
    cc = stage_costs(graph, pol, ctx)
    if copy_exposed > 0:
        for c in cc:
            c.copy_exposed = copy_exposed / len(cc)
            c.bwd_base += c.copy_exposed
    if edges is not None:
        if ctx.stage == 0:
            cc[0].fwd_plain += edges.embedding_fwd
            cc[0].bwd_base += edges.embedding_bwd
        if ctx.stage == ctx.num_stages - 1:
            cc[-1].fwd_plain += edges.head_fwd
            cc[-1].bwd_base += edges.head_bwd
    return cc
