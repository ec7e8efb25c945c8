"""The op timeline of one pipeline stage that Lynx-OPT and Checkmate schedule over.

The paper's Table 3 indexes everything by *phases* t = 1..T: op t runs in phase t, and other ops may be
(re)computed in phase t too. For one micro-batch j of a stage with L layers of n ops the phases are:

1. ``fwd``  - the forward of every op of every layer, bottom layer first (L * n phases);
2. ``host`` - only with overlap and forward windows: the attention and MLP forward collectives of the
   *next* forward pass on this stage (1F1B runs F(j+w) before B(j)), two per layer, which host the
   phase-1/2 recomputation of the same layer of micro-batch j (2 * L phases, no op of j runs there);
3. ``bwd``  - the backward of every op, top layer first, ops in reverse (L * n phases). The backward
   collective of layer l+1's MLP (attention) block is a window that hosts the phase-3 (4) recomputation of
   layer l; the top layer has no layer above, so it has no phase-3/4 windows (as the simulator charges it).

Recomputation of layer l outside a window happens in layer l's own backward phases: phase 5, on demand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lynx.cost.pricing import op_recompute_cost
from lynx.decisions import Phase
from lynx.graph import LAYER_INPUT, LayerGraph

StageKind = Literal["fwd", "host", "bwd"]


@dataclass(frozen=True, slots=True)
class TimeStage:
    """One phase t of the timeline."""

    kind: StageKind
    layer: int
    """fwd / bwd: the layer whose op runs; host: the layer whose recomputation the window hosts."""
    op: int
    """fwd / bwd: index of the op in the layer graph; host: -1."""
    window: Phase | None = None
    """The recomputation phase this stage's collective window offers (1-4), or None."""
    serves: int = -1
    """The layer whose ops may be recomputed in the window (-1: no window)."""
    capacity: float = 0.0
    """Idle seconds of the window (C2's C_t)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """An op that may be (re)computed in a post-forward stage: node index and whether it is in a window."""

    node: int
    in_window: bool


@dataclass(frozen=True)
class Timeline:
    graph: LayerGraph
    num_layers: int
    overlap: bool
    stages: tuple[TimeStage, ...]
    first_post: int
    """Index of the first stage after the forward (t_B: S there is what the layer policy keeps)."""
    region_end: tuple[int, ...]
    """Per layer: the last stage of its backward (after it, nothing of the layer is retained)."""

    @property
    def n_ops(self) -> int:
        return len(self.graph.ops)

    @property
    def num_nodes(self) -> int:
        return self.num_layers * self.n_ops

    def node(self, layer: int, op: int) -> int:
        return layer * self.n_ops + op

    def layer_of(self, v: int) -> int:
        return v // self.n_ops

    def op_of(self, v: int) -> int:
        return v % self.n_ops

    def fwd_stage(self, v: int) -> int:
        """Forward stages are laid out node by node: node v runs in forward stage v."""
        return v

    def mem(self, v: int) -> float:
        """M_v: bytes of op v's output and mask (the layer output counts as the next layer's input)."""
        return self.graph.keep_bytes(self.graph.ops[self.op_of(v)].name)

    def cost(self, v: int) -> float:
        """C_v: forward (= recompute) time of op v."""
        return op_recompute_cost(self.graph, self.graph.ops[self.op_of(v)].name)

    def inputs(self, v: int) -> tuple[int, ...]:
        """Nodes whose outputs op v reads (the layer input is always stored, so it is left out)."""
        ly, names = self.layer_of(v), self.graph.names
        return tuple(self.node(ly, names.index(d)) for d in self.graph.ops[self.op_of(v)].inputs if d != LAYER_INPUT)

    def saved(self, v: int) -> tuple[int, ...]:
        """Nodes whose stored state the backward of op v reads."""
        ly, names = self.layer_of(v), self.graph.names
        return tuple(self.node(ly, names.index(d)) for d in self.graph.ops[self.op_of(v)].saved if d != LAYER_INPUT)

    def stage_node(self, t: int) -> int:
        """The node whose forward or backward stage t is (fwd/bwd stages only)."""
        st = self.stages[t]
        return self.node(st.layer, st.op)

    def candidates(self, t: int) -> tuple[Candidate, ...]:
        """Ops that may be recomputed in post-forward stage t, in the order they would run.

        (C1) R_{t,i} = 0 for i in COMM when t is a window: a collective cannot run inside another's window,
        so window candidates are compute ops only. Phase 5 (the own layer's backward phases) takes any op.
        """
        st = self.stages[t]
        if st.kind == "fwd":
            return ()
        out: list[Candidate] = []
        if st.serves >= 0:
            out += [Candidate(self.node(st.serves, i), True) for i, o in enumerate(self.graph.ops) if not o.is_comm]
        if st.kind == "bwd":
            out += [Candidate(self.node(st.layer, i), False) for i in range(self.n_ops)]
        return tuple(out)

    def alive_range(self, v: int) -> range:
        """Stages t at which S_{t,v} may be 1: after v's forward, up to the end of its layer's backward."""
        return range(self.fwd_stage(v) + 1, self.region_end[self.layer_of(v)] + 1)


def build_timeline(graph: LayerGraph, num_layers: int, has_fwd_windows: bool, overlap: bool,
                   subtract_wgrad: bool = True) -> Timeline:
    """The phases of one micro-batch on a stage; `overlap=False` (Checkmate) has no windows at all."""
    n = len(graph.ops)
    stages: list[TimeStage] = [TimeStage("fwd", ly, i) for ly in range(num_layers) for i in range(n)]
    first_post = len(stages)
    if overlap and has_fwd_windows:
        for ly in range(num_layers):
            stages.append(TimeStage("host", ly, -1, Phase.FWD_ATTN, ly, graph.fwd_window("attn")))
            stages.append(TimeStage("host", ly, -1, Phase.FWD_MLP, ly, graph.fwd_window("mlp")))
    region_end = [0] * num_layers
    for ly in range(num_layers - 1, -1, -1):
        for i in range(n - 1, -1, -1):
            op = graph.ops[i]
            if overlap and op.is_comm and ly >= 1:
                ph = Phase.BWD_MLP if op.block == "mlp" else Phase.BWD_ATTN
                # Only the idle part of the backward collective (comm - wgrad with Megatron's overlap).
                cap = graph.bwd_window(op.block, subtract_wgrad) * _share(graph, op.name, op.block)
                stages.append(TimeStage("bwd", ly, i, ph, ly - 1, cap))
            else:
                stages.append(TimeStage("bwd", ly, i))
        region_end[ly] = len(stages) - 1
    return Timeline(graph, num_layers, overlap, tuple(stages), first_post, tuple(region_end))


def _share(graph: LayerGraph, name: str, block: str) -> float:
    """A block may have several collectives (sequence parallelism): split its idle time by comm time."""
    comms = [o for o in graph.ops if o.is_comm and o.block == block]
    total = sum(o.bwd_time for o in comms)
    return graph.op(name).bwd_time / total if total > 0 else 1.0 / max(1, len(comms))
