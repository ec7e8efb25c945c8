"""The one price list every solver and the simulator read: what recomputing an op costs and how much idle time
each window offers. Lynx-HEU's objective (`policy.heu_objective`), its MILP rows (`policy.heu`) and the event
simulator (`simulate.pricing`) all call these, so a plan is chosen on the prices it is judged by.

* Recomputing an op costs its forward re-run (`Op.recompute_time`: a collective re-run in a recomputed
  forward without TransformerEngine's userbuffers overlap keeps its whole time) plus, for a graph measured on
  a runtime (`lynx profile`), the recompute engine's own time per restoration (`RuntimeCosts.restore_op_s`).
* Windows: forward collectives are idle in full; backward ones offer ``comm - wgrad`` when Megatron already
  overlaps the weight-gradient GEMM (`LayerGraph.bwd_window`).

Work outside the layers (embedding, LM head, loss) is priced once for the partitioners and the simulator in
`lynx.cost.edges`; solvers see only the layer graph, so this module imports nothing but it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lynx.decisions import BWD_PHASES, FWD_PHASES, LayerPolicy, Phase, StageContext
from lynx.graph import Block, LayerGraph


def restore_overhead(graph: LayerGraph) -> float:
    """The runtime's own time per restored op (0 for analytic graphs)."""
    rc = graph.runtime
    return rc.restore_op_s if rc is not None and rc.restore_op_s > 0 else 0.0


def op_recompute_cost(graph: LayerGraph, name: str) -> float:
    """Seconds to restore one op: its forward re-run plus the engine's per-restoration time."""
    return graph.op(name).recompute_time + restore_overhead(graph)


def ops_recompute_cost(graph: LayerGraph, names: Iterable[str]) -> float:
    return sum(op_recompute_cost(graph, n) for n in names)


def fwd_windows(graph: LayerGraph) -> tuple[float, float]:
    """Idle time of the attention and MLP forward collectives (phases 1, 2)."""
    return graph.fwd_window("attn"), graph.fwd_window("mlp")


def bwd_windows(graph: LayerGraph, subtract_wgrad: bool) -> tuple[float, float]:
    """Idle time of the MLP and attention backward collectives (phases 3, 4, in that order)."""
    return graph.bwd_window("mlp", subtract_wgrad), graph.bwd_window("attn", subtract_wgrad)


def block_window(graph: LayerGraph, block: Block, backward: bool, subtract_wgrad: bool = True) -> float:
    return graph.bwd_window(block, subtract_wgrad) if backward else graph.fwd_window(block)



def fsdp_window(graph: LayerGraph, ctx: StageContext) -> float:
    """Idle time of one layer's backward step under FSDP: the gather of the layer below and the reduce-scatter of
    the layer above outlast the layer's backward (compute and exposed TP collectives), and the layer's own
    on-demand recomputation may run in it (its parameters are gathered by then; `lynx.cost.fsdp_time`)."""
    f = ctx.fsdp
    if f is None:
        return 0.0
    bwd = sum(o.bwd_time for o in graph.ops if not o.is_comm) + graph.exposed_bwd_comm(ctx.subtract_wgrad)
    return max(0.0, f.gather_bwd_s + f.reduce_s - bwd)


def recompute_time(graph: LayerGraph, lp: LayerPolicy, phases: tuple[Phase, ...]) -> float:
    """The recomputation of these phases at the price list; on demand also the kept ops a Megatron checkpoint
    re-runs (`LayerPolicy.rerun`; lynx's own policies re-run none)."""
    rerun = ops_recompute_cost(graph, sorted(lp.rerun)) if Phase.ON_DEMAND in phases else 0.0
    return ops_recompute_cost(graph, lp.recomputed(phases)) + rerun


@dataclass(frozen=True, slots=True)
class LayerRecompute:
    """One layer's recomputation under its policy, by where it runs."""

    on_demand: float
    """On the critical path before the layer's backward: phase 5 (with Megatron's re-runs), what overflows the
    backward windows, and for a chunk's top layer its phases 3/4 (no layer above lends it backward windows)."""
    bwd_hidden: float
    """Phases 3/4 hidden inside the backward collectives of the layer above, and on-demand work hidden in
    the layer's FSDP window."""
    fwd_loads: tuple[float, float]
    """Phases 1 and 2: placed in a later forward's windows, which the caller prices (they depend on the host)."""


def layer_recompute(graph: LayerGraph, lp: LayerPolicy, win_b: tuple[float, float], top: bool,
                    fsdp_win: float = 0.0) -> LayerRecompute:
    """The backward-window overflow rule, once for the HEU objective and the simulator: phase 3/4 work beyond a
    window's idle time `win_b` (phase 3, 4 order, `bwd_windows`) runs on demand; on-demand work hides in the
    layer's FSDP window `fsdp_win` (`fsdp_window`; the caller charges the window itself as exposed time)."""
    demand = recompute_time(graph, lp, (Phase.ON_DEMAND,))
    hidden = 0.0
    for k, ph in enumerate(BWD_PHASES):
        load = recompute_time(graph, lp, (ph,))
        if top:
            demand += load
        else:
            hidden += min(load, win_b[k])
            demand += max(0.0, load - win_b[k])
    f1, f2 = (recompute_time(graph, lp, (ph,)) for ph in FWD_PHASES)
    in_fsdp = min(demand, fsdp_win)
    return LayerRecompute(demand - in_fsdp, hidden + in_fsdp, (f1, f2))
