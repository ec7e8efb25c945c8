"""Activation lifetimes during backward: what a layer policy actually holds while its layers' backward runs.

An op-level replay of what the recompute engine (`lynx.runtime.engine`, like Megatron's checkpointed
re-forward) does for one micro-batch, used by the one memory rule in `lynx.cost.memory`:

* backward visits a stage's layers top first and each layer's ops in reverse forward order; an op's
  backward reads its ``saved`` tensors (its own mask or statistics when it has any), and a read of a dropped
  tensor restores it on demand;
* restoring op X first restores whatever of its inputs is neither kept nor restored (recursively; a layer
  whose input is not checkpointed restores the layer below's output: a uniform chunk restores all its layers);
* after every restore, outputs of the layer that no backward reads are freed once every op reading them is
  restored, kept or never rebuilt, unless an op being restored reads them (masks and statistics stay), and a
  chunk's top output stays until the layer above is done;
* a kept op that a Megatron checkpoint re-runs (`LayerPolicy.rerun`) holds a fresh output and side state from
  its re-run, right before its backward, until the layer's release;
* phase 1/2 ops are restored in a later forward's windows (the "forward holdings"), phase 3/4 ops of layer
  l - 1 inside layer l's column-parallel backward (after the MLP's / attention's first GEMM backward), the rest
  on demand; a layer's restored tensors are released when its backward ends.

The memory is sampled at every release and, for every restore, twice: once the restored output exists while
its inputs are still alive (the restoration's working set, what the CUDA allocator sees: torch frees an input
only after the op that reads it has returned its output), and again after the frees. The recompute engine's
byte ledger counts a restoration only after the frees; `transient=False` replays that view (what
`runtime.check` compares against, exactly). On one H100 the allocator's peak was 8-23% above the after-the-
frees model for every plan that recomputes (docs/results.md, `restoration_peaks`). A layer output rebuilt for
its dropout mask counts whole in that moment (one `s b h / t` tensor beside the mask it is rebuilt for); HEU's
and OPT's linear rows add it (`memory.restored_output_bytes`) to stay an upper bound (docs/concepts/memory.md,
"The solvers").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lynx.decisions import BWD_PHASES, FWD_PHASES, LayerPolicy, Phase
from lynx.graph import LAYER_INPUT, Graphs, LayerGraph, graphs_key, per_graph, per_layer, same_graphs

_BWD_BLOCK = {Phase.BWD_MLP: "mlp", Phase.BWD_ATTN: "attn"}


@dataclass
class _Layer:
    pol: LayerPolicy
    ckpt: bool
    chunk_top: bool
    out: dict[str, float] = field(default_factory=dict)
    """Restored op -> bytes of its output still alive (0 once freed)."""
    side: dict[str, float] = field(default_factory=dict)
    """Restored op -> its mask / statistics bytes (alive until release)."""
    cached: float | None = None
    """`total()` since the last change of `out` / `side` (the replay samples far more often than it
    changes a layer; the same sums in the same order, so the figures are unchanged)."""

    def total(self) -> float:
        if self.cached is None:
            self.cached = sum(self.out.values()) + sum(self.side.values())
        return self.cached


@dataclass(frozen=True)
class _GraphFacts:
    """What the replay reads of one layer graph, once per graph."""

    users: dict[str, tuple[str, ...]]
    read_out: frozenset[str]


def _graph_facts(graph: LayerGraph, extra: Mapping[str, float]) -> _GraphFacts:
    return _GraphFacts({o.name: tuple(u.name for u in graph.ops if o.name in u.inputs) for o in graph.ops},
                       frozenset(s for o in graph.ops for s in o.saved
                                 if s != o.name or (o.mask_bytes == 0 and not extra.get(o.name))))


class _Replay:
    def __init__(self, graph: Graphs, layers: Sequence[LayerPolicy], extra: Mapping[str, float],
                 transient: bool = True) -> None:
        self.extra, self.transient = extra, transient
        n = len(layers)
        self.gs = per_layer(graph, n)
        self.layers = [_Layer(lp, i == 0 or lp.input_checkpoint,
                              i + 1 < n and not layers[i + 1].input_checkpoint) for i, lp in enumerate(layers)]
        # distinct graphs by identity (hashing a graph hashes every op; a stage repeats one graph object)
        facts = {i: _graph_facts(g, extra) for i, g in {id(g): g for g in self.gs}.items()}
        self.facts = [facts[id(g)] for g in self.gs]
        self.planned = [frozenset(lp.recomputed()) for lp in layers]
        self.restoring: set[tuple[int, str]] = set()
        self.peak = 0.0
        self.released = 0.0
        """Retained bytes of layers whose backward is done (freed with their record)."""
        self.active: set[int] = set()
        """Layers holding restored bytes; the others add nothing to `total` (skipping a zero term leaves a
        float sum unchanged, and the active ones are summed in layer order as before)."""

    def total(self) -> float:
        return sum(self.layers[i].total() for i in sorted(self.active)) - self.released

    def retained(self, li: int) -> float:
        lp, g = self.layers[li].pol, self.gs[li]
        kept = sum(g.keep_bytes(n) + self.extra.get(n, 0.0) for n in lp.keep)
        kept -= sum(g.op(n).mask_bytes for n in lp.rerun)
        return kept + (g.input_bytes if lp.input_checkpoint else 0.0)

    def sample(self) -> None:
        self.peak = max(self.peak, self.total())

    def ensure(self, li: int, op: str, as_input: bool = False) -> None:
        """Restore `op` of layer `li` unless alive; `as_input`: the layer above reads this layer's output."""
        st = self.layers[li]
        if op in st.out or (op in st.pol.keep and not as_input):
            return
        self.restoring.add((li, op))
        g = self.gs[li]
        for d in g.op(op).inputs:
            if d == LAYER_INPUT:
                if not st.ckpt:
                    self.ensure(li - 1, self.gs[li - 1].output_op, True)
            else:
                self.ensure(li, d)
        self.restoring.discard((li, op))
        o = g.op(op)
        st.out[op] = o.out_bytes
        st.side[op] = o.mask_bytes + self.extra.get(op, 0.0)
        st.cached = None
        self.active.add(li)
        if self.transient:  # the output beside its inputs, before they are freed (a layer output too)
            self.peak = max(self.peak, self.total())
        self.free(li)
        self.sample()

    def free(self, li: int) -> None:
        st, out_op, facts = self.layers[li], self.gs[li].output_op, self.facts[li]
        for name, b in st.out.items():
            if not b or name in facts.read_out or (st.chunk_top and name == out_op):
                continue
            users = facts.users[name]
            if any((li, c) in self.restoring for c in users):
                continue
            if all(c in st.out or c in st.pol.keep or c not in self.planned[li] for c in users):
                st.out[name] = 0.0
                st.cached = None

    def prefill(self, li: int) -> None:
        """Phase 1/2 restores of a later forward's windows (attention's, then the MLP's)."""
        for ph in FWD_PHASES:
            for name, p in self.layers[li].pol.recompute:
                if p == ph:
                    self.ensure(li, name)

    def backward(self, li: int) -> None:
        st, g = self.layers[li], self.gs[li]
        trigger = {blk: _window_op(g, blk) for blk in ("attn", "mlp")}
        for o in reversed(g.ops):
            if o.name in st.pol.rerun:  # a Megatron checkpoint re-runs it: a fresh output and side state
                for d in o.inputs:
                    if d != LAYER_INPUT:
                        self.ensure(li, d)
                st.side[o.name] = o.out_bytes + o.mask_bytes
                self.sample()
            for s in o.saved:
                if s == LAYER_INPUT:
                    if not st.ckpt:
                        self.ensure(li - 1, self.gs[li - 1].output_op, True)
                elif s not in st.pol.keep:
                    self.ensure(li, s)
            if self.extra.get(o.name) and o.name not in st.pol.keep:
                self.ensure(li, o.name)
            if li > 0:
                for ph, blk in _BWD_BLOCK.items():
                    if trigger[blk] == o.name:
                        for name, p in self.layers[li - 1].pol.recompute:
                            if p == ph:
                                self.ensure(li - 1, name)
        self.sample()
        self.layers[li].out.clear()
        self.layers[li].side.clear()
        self.layers[li].cached = None
        self.active.discard(li)
        self.released += self.retained(li)


@per_graph
def _window_op(g: LayerGraph, blk: str) -> str:
    """The op whose backward opens the block's backward window: an MoE block's combine (all-to-all, the
    first collective of its backward, which the runtime's engine hosts the window in, whatever the TP:
    `runtime/layers/moe_dispatch.py`, docs/decisions/0224 and 0225), else the column-parallel GEMM whose
    weight gradient overlaps the block's backward collective (QKV, FC1)."""
    moe = [c.name for c in g.comm_ops() if c.block == blk and c.module == "moe"]  # the token dispatcher's
    if moe:
        return moe[-1]
    for c in g.comm_ops():
        if c.block == blk and c.overlaps_wgrad_of:
            return c.overlaps_wgrad_of
    return ""


@dataclass(frozen=True, slots=True)
class BackwardTrace:
    """Bytes restored for backward (beyond what forward kept) in one micro-batch's pass through a stage."""

    fwd_held: tuple[float, ...]
    """Per layer: what its phase-1/2 restores leave alive (held from the later forward until backward)."""
    layer_peak: tuple[float, ...]
    """Per layer (bottom first): the largest restored total while its backward runs, relative to the start
    of the pass (forward holdings included when they were restored before), less the retained bytes of the
    layers above, released when their backward ended."""
    layer_restored: tuple[float, ...]
    """The same without the credit for released layers (for stages whose held count is not this pass's)."""
    fwd_transient: float = 0.0
    """With forward windows: the most the phase-1/2 restores have alive beyond their final holdings
    (`sum(fwd_held)`) while they run in a later forward (a restoration's inputs beside its output)."""

    @property
    def peak(self) -> float:
        return max(self.layer_peak, default=0.0)

    @property
    def restored_peak(self) -> float:
        return max(self.layer_restored, default=0.0)


def forward_holdings(graph: Graphs, layers: Sequence[LayerPolicy],
                     extra: Mapping[str, float] | None = None) -> tuple[float, ...]:
    rep = _Replay(graph, layers, extra or {})
    out = []
    for li in range(len(layers)):
        rep.prefill(li)
        out.append(rep.layers[li].total())
    return tuple(out)


_TRACES: OrderedDict[tuple[object, ...], tuple[Graphs, BackwardTrace]] = OrderedDict()
TRACE_CACHE_SIZE = 4096
"""Replays remembered (least recently used dropped): the partition refinement and the configuration search
ask for the same stage's trace again and again, and one replay of a deep stage takes tens of ms."""


def backward_trace(graph: Graphs, layers: Sequence[LayerPolicy], fwd_windows: bool,
                   extra: Mapping[str, float] | None = None, transient: bool = True) -> BackwardTrace:
    """Replay one micro-batch's backward through `layers` (one stage or chunk, bottom first). With
    `fwd_windows` the phase-1/2 ops were restored in a later forward (held, counted by `fwd_held`);
    without, they are restored on demand like phase 5. `extra`: bytes per op beyond the graph (the runtime's
    LayerNorm statistics), held with the op's mask. `transient`: count each restoration's working set (its
    output beside its inputs, before the frees: the allocator's view, which plans are judged by); False: sample
    after the frees only (the recompute engine's byte ledger). Results are memoized per graph object, policies
    and options."""
    key = (graphs_key(graph), tuple(layers), fwd_windows, tuple(sorted(extra.items())) if extra else (), transient)
    hit = _TRACES.get(key)
    if hit is not None and same_graphs(hit[0], graph):
        _TRACES.move_to_end(key)
        return hit[1]
    trace = _backward_trace(graph, layers, fwd_windows, extra, transient)
    _TRACES[key] = (graph, trace)
    if len(_TRACES) > TRACE_CACHE_SIZE:
        _TRACES.popitem(last=False)
    return trace


_CROSS_PHASES = frozenset(BWD_PHASES)
"""Restored inside the backward of the layer above: a layer holding one is not replayed on its own."""


def _independent(layers: Sequence[LayerPolicy], fwd_windows: bool) -> bool:
    """Whether no layer's backward touches another's bytes: every layer above the first checkpoints its input (no
    restore reaches the layer below, no layer output is a chunk top), nothing is restored in the backward of the
    layer above (phases 3/4), and nothing is held from a later forward (phases 1/2 with forward windows; without,
    they are restored on demand in the layer's own backward)."""
    cross = _CROSS_PHASES | (frozenset(FWD_PHASES) if fwd_windows else frozenset())
    return all((i == 0 or lp.input_checkpoint) and not any(p in cross for _, p in lp.recompute)
               for i, lp in enumerate(layers))


def _independent_trace(graph: Graphs, layers: Sequence[LayerPolicy], extra: Mapping[str, float],
                       transient: bool) -> BackwardTrace:
    """`_backward_trace` of independent layers (`_independent`) from one replay per distinct (graph, policy): the
    same floats. In the full replay, while layer l's backward runs, only l holds restored bytes, so every sample is
    (l's restored total) - r, r the retained bytes of the layers above released so far (accumulated top down as the
    replay does); the largest is fl(V - r), V the largest restored total (at least 0, the pass's start) of l's own
    one-layer replay, which runs the very same operations (fl(v - r) grows with v). The forward holdings are 0.
    tests/unit/test_lifetime.py compares both on every method's policies."""
    gs = per_layer(graph, len(layers))
    tops: dict[tuple[int, int], tuple[float, float]] = {}
    peaks, restored = [0.0] * len(layers), [0.0] * len(layers)
    released = 0.0
    for li in range(len(layers) - 1, -1, -1):
        key = (id(gs[li]), id(layers[li]))  # both alive for the call: ids unique
        got = tops.get(key)
        if got is None:
            one = _Replay(gs[li], (layers[li],), extra, transient)
            one.peak = one.total()
            one.backward(0)
            got = tops[key] = (one.peak, one.released)
        top, kept = got
        peaks[li] = (top - released) - 0.0
        restored[li] = peaks[li] + released
        released += kept
    return BackwardTrace((0.0,) * len(layers), tuple(peaks), tuple(restored), 0.0)


def _backward_trace(graph: Graphs, layers: Sequence[LayerPolicy], fwd_windows: bool,
                    extra: Mapping[str, float] | None, transient: bool) -> BackwardTrace:
    if _independent(layers, fwd_windows):
        return _independent_trace(graph, layers, extra or {}, transient)
    return _replayed_trace(graph, layers, fwd_windows, extra or {}, transient)


def _replayed_trace(graph: Graphs, layers: Sequence[LayerPolicy], fwd_windows: bool, extra: Mapping[str, float],
                    transient: bool) -> BackwardTrace:
    """The replay of the whole pass, layer after layer."""
    rep = _Replay(graph, layers, extra, transient)
    held = []
    for li in range(len(layers)):
        if fwd_windows:
            rep.prefill(li)
        held.append(rep.layers[li].total())
    start = sum(held)
    fwd_transient = max(0.0, rep.peak - start)  # rep.peak: the prefill's samples (0 without forward windows)
    peaks, restored = [0.0] * len(layers), [0.0] * len(layers)
    for li in range(len(layers) - 1, -1, -1):
        rep.peak = rep.total()
        before = rep.released
        rep.backward(li)
        peaks[li] = rep.peak - start
        restored[li] = peaks[li] + before
    return BackwardTrace(tuple(held), tuple(peaks), tuple(restored), fwd_transient)

