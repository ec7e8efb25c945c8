"""The layer op graph: the contract between planner and runtime.

One transformer layer is a short list of named ops (the *op vocabulary*, docs/design in shared/design.md).
The planner decides per op whether its output is kept for backward or recomputed (and when); the runtime
builds its layer from the same names, so a plan applies without translation.

Memory semantics (per op ``i``):

* ``out_bytes``  - the output tensor on one device.
* ``mask_bytes`` - side state its backward needs besides tensors (dropout mask, 1 byte/element).
* ``saved``      - the ops whose stored state the backward of ``i`` reads; ``"input"`` is the layer input.
  A dropout-like op lists itself (its mask).

Keeping op ``i`` (``S_i = 1``) costs ``keep_bytes(i) = out_bytes + mask_bytes``, except that the output of the
layer's last op is the next layer's input and is accounted there. The layer input is always kept (it is
the checkpoint every policy keeps).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar

from lynx.errors import PlanFormatError
from lynx.validate import build, check_field

LAYER_INPUT = "input"
GRAPH_SCHEMA_VERSION = 1

OpKind = Literal["compute", "comm"]
Block = Literal["attn", "mlp"]

@dataclass(frozen=True, slots=True)
class Op:
    """One op of a transformer layer. Times are seconds on one device; bytes are per device."""

    name: str
    kind: OpKind
    block: Block
    fwd_time: float
    """Compute: forward kernel time. Comm: forward collective time (compute units idle meanwhile)."""
    bwd_time: float
    """Compute: input-gradient plus weight-gradient time. Comm: backward collective time."""
    out_bytes: float
    inputs: tuple[str, ...]
    saved: tuple[str, ...] = ()
    mask_bytes: float = 0.0
    wgrad_time: float = 0.0
    """Part of ``bwd_time`` that is weight-gradient work (compute ops with weights)."""
    overlaps_wgrad_of: str | None = None
    """Comm ops: the op whose weight-gradient GEMM Megatron runs while this backward collective is in flight."""
    fwd_flops: float = 0.0
    module: str = ""
    """Megatron-Core's --recompute-modules name the op belongs to ("layernorm", "core_attn", "mlp"; "" for
    none): how `--compare`'s module-list baselines and Megatron's selective recomputation pick ops."""
    regather_time: float = 0.0
    """Comm ops (SP all-gather): part of ``bwd_time`` re-gathering the sharded input for the weight gradient
    of ``overlaps_wgrad_of``, in flight while that GEMM's input gradient is computed."""

    rerun_time: float | None = None
    """Comm ops under --tp-comm-overlap: the collective's whole time when a recomputed forward re-runs it
    (TransformerEngine turns the userbuffers overlap off inside a recomputed forward, TransformerEngine
    #2902); None: ``fwd_time``."""

    @property
    def is_comm(self) -> bool:
        return self.kind == "comm"

    @property
    def recompute_time(self) -> float:
        """What re-running this op's forward costs (a recomputed forward, Megatron's or Lynx's)."""
        return self.fwd_time if self.rerun_time is None else self.rerun_time


@dataclass(frozen=True, slots=True)
class GraphMeta:
    """Where a graph came from and what it describes."""

    source: str = "analytic"
    """"analytic" (cost model) or "profile:<id>" (measured)."""
    model: str = ""
    hidden_size: int = 0
    num_attention_heads: int = 0
    ffn_hidden_size: int = 0
    seq_length: int = 0
    micro_batch_size: int = 0
    tp: int = 1
    sequence_parallel: bool = False
    device: str = ""
    dtype: str = "bf16"
    family: str = "gpt"
    num_query_groups: int = 0
    """0: as many as attention heads (no grouped-query attention)."""
    cp: int = 1
    """Context parallelism: the graph holds seq_length / cp tokens of each sequence (written only when > 1)."""


@dataclass(frozen=True, slots=True)
class RuntimeCosts:
    """What the runtime spends beyond the layer's ops, measured by `lynx profile` on the profiled device
    (docs/runtime-overhead.md). A graph that carries it has the simulator price it; analytic graphs do not."""

    restore_op_s: float = 0.0
    """The recompute engine's own time per restored op (bookkeeping, hooks, detaching, allocation), over
    the op's forward time: restore time minus forward time, median over the layer's ops."""
    gemm_flops: float = 0.0
    """The device's measured GEMM rate (FLOP/s): prices the LM head where the plan's hardware preset does not
    describe the profiled device (0: use the hardware's)."""
    memory_bw_Bps: float = 0.0
    """The device's measured copy bandwidth (bytes/s): embedding, loss and optimizer step (0: the hardware's)."""

    def __post_init__(self) -> None:
        for k in ("restore_op_s", "gemm_flops", "memory_bw_Bps"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0.0 or v == float("inf"):
                raise PlanFormatError(f"graph: runtime.{k} must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True, slots=True)
class LayerGraph:
    """The ops of ONE transformer layer in forward order, with the layer input's size."""

    ops: tuple[Op, ...]
    input_bytes: float
    meta: GraphMeta = field(default_factory=GraphMeta)
    runtime: RuntimeCosts | None = None
    """Measured runtime costs beyond the ops (profiled graphs only); None: the ops are the whole price."""
    _by_name: dict[str, Op] = field(init=False, repr=False, compare=False, hash=False)
    """Lookups derived from `ops` once (the graph is frozen): the planners and the memory replay ask `op`,
    `names` and `needed` millions of times in a configuration search."""
    _names: tuple[str, ...] = field(init=False, repr=False, compare=False, hash=False)
    _needed: frozenset[str] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.ops:
            raise PlanFormatError("graph: no ops (a layer graph lists its layer's ops in forward order)")
        seen: set[str] = {LAYER_INPUT}
        for op in self.ops:
            if op.name in seen:
                raise PlanFormatError(f"graph: op name {op.name!r} repeats or shadows the layer input")
            for dep in op.inputs:
                if dep not in seen:
                    raise PlanFormatError(f"graph: op {op.name!r} reads {dep!r}, which comes later or not at all")
            seen.add(op.name)
        names = {o.name for o in self.ops} | {LAYER_INPUT}
        for op in self.ops:
            bad = [s for s in op.saved if s not in names]
            if bad:
                raise PlanFormatError(f"graph: op {op.name!r} saves unknown op(s) {bad}")
            if min(op.fwd_time, op.bwd_time, op.out_bytes, op.mask_bytes, op.wgrad_time) < 0:
                raise PlanFormatError(f"graph: op {op.name!r} has a negative time or size")
        object.__setattr__(self, "_by_name", {o.name: o for o in self.ops})
        object.__setattr__(self, "_names", tuple(o.name for o in self.ops))
        object.__setattr__(self, "_needed", frozenset(s for o in self.ops for s in o.saved if s != LAYER_INPUT))

    # -- lookups -------------------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    def op(self, name: str) -> Op:
        return self._by_name[name]  # KeyError for an unknown name, as the scan raised

    def index(self, name: str) -> int:
        return self.names.index(name)

    @property
    def output_op(self) -> str:
        return self.ops[-1].name

    def needed(self) -> frozenset[str]:
        """Ops whose stored state some backward reads (the layer input excluded)."""
        return self._needed

    def keep_bytes(self, name: str) -> float:
        """Bytes held for backward per micro-batch when op `name` is kept (S = 1)."""
        op = self.op(name)
        out = 0.0 if name == self.output_op else op.out_bytes
        return out + op.mask_bytes

    def retained_bytes(self, keep: Iterable[str]) -> float:
        """Bytes one layer holds from its forward until its backward, keeping `keep` (plus the input)."""
        return self.input_bytes + sum(self.keep_bytes(n) for n in set(keep))

    def full_activation_bytes(self) -> float:
        """Every op's output and mask of one layer: the working set while a layer runs or is recomputed."""
        return self.input_bytes + sum(o.out_bytes + o.mask_bytes for o in self.ops[:-1]) + self.ops[-1].mask_bytes

    def module_ops(self, module: str) -> tuple[str, ...]:
        """The ops of a Megatron-Core recompute module ("layernorm", "core_attn", "mlp"), forward order."""
        return tuple(o.name for o in self.ops if o.module == module)

    def comm_ops(self, block: Block | None = None) -> tuple[Op, ...]:
        return tuple(o for o in self.ops if o.is_comm and (block is None or o.block == block))

    def fwd_time(self) -> float:
        return sum(o.fwd_time for o in self.ops)

    def bwd_time(self) -> float:
        return sum(o.bwd_time for o in self.ops)

    def fwd_window(self, block: Block) -> float:
        """Idle compute time of the block's forward collectives (phases 1 and 2)."""
        return sum(o.fwd_time for o in self.comm_ops(block))

    def bwd_window(self, block: Block, subtract_wgrad: bool = True) -> float:
        """Idle compute time of the block's backward collectives (phases 3 and 4).

        Megatron already runs the weight-gradient GEMM of the column-parallel linear while the
        input-gradient all-reduce (SP: reduce-scatter) is in flight, so only ``comm - wgrad`` is idle;
        SP's re-gather of the input overlaps the input-gradient GEMM; the SP reduce-scatter's backward
        all-gather overlaps nothing (`exposed_bwd_time`).
        """
        return sum(self.exposed_bwd_time(o, subtract_wgrad) for o in self.comm_ops(block))

    def exposed_bwd_time(self, o: Op, subtract_wgrad: bool = True) -> float:
        """Backward time of comm op `o` that no GEMM hides (Megatron-Core's overlaps, docs/costmodel.md)."""
        if not (subtract_wgrad and o.overlaps_wgrad_of):
            return o.bwd_time
        g = self.op(o.overlaps_wgrad_of)
        return max(0.0, o.bwd_time - o.regather_time - g.wgrad_time) \
            + max(0.0, o.regather_time - (g.bwd_time - g.wgrad_time))

    def step_time(self, subtract_wgrad: bool = True) -> float:
        """Forward plus backward of one layer without recomputation, as the simulator charges them: compute,
        blocking forward collectives, and the backward collectives' exposed part."""
        return self.fwd_time() + sum(o.bwd_time for o in self.ops if not o.is_comm) \
            + self.exposed_bwd_comm(subtract_wgrad)

    def exposed_bwd_comm(self, subtract_wgrad: bool = True) -> float:
        """Backward collective time the critical path sees (the wgrad overlap removed)."""
        return self.bwd_window("attn", subtract_wgrad) + self.bwd_window("mlp", subtract_wgrad)

    # -- JSON ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {
            "schema_version": GRAPH_SCHEMA_VERSION,
            "meta": {k: v for k, v in asdict(self.meta).items() if k != "cp" or v != 1},
            "input_bytes": self.input_bytes,
            "ops": [asdict(o) for o in self.ops],
        }
        if self.runtime is not None:  # absent from analytic graphs: their JSON is unchanged
            out["runtime"] = asdict(self.runtime)
        return out

    @staticmethod
    def from_dict(d: Mapping[str, Any], legacy_modules: Mapping[str, str] | None = None) -> LayerGraph:
        """`legacy_modules`: op name -> Megatron module for graphs stored before ops carried their module
        (those are GPT graphs: readers above the families pass `lynx.families.gpt.MODULE_OF`)."""
        if not isinstance(d, Mapping):
            raise PlanFormatError(f"graph: expected a JSON object, got {type(d).__name__}")
        try:
            if d.get("schema_version") != GRAPH_SCHEMA_VERSION:
                raise PlanFormatError(
                    f"graph: schema_version {d.get('schema_version')!r}, expected {GRAPH_SCHEMA_VERSION}"
                )
            ops = []
            for i, od in enumerate(d["ops"]):
                if isinstance(od, Mapping) and "module" not in od and legacy_modules is not None:
                    od = {**od, "module": legacy_modules.get(str(od.get("name")), "")}
                ops.append(build(Op, od, f"graph: ops[{i}]", PlanFormatError))
            rt = d.get("runtime")
            runtime = None if rt is None else build(RuntimeCosts, rt, "graph: runtime", PlanFormatError)
            return LayerGraph(tuple(ops), check_field(d["input_bytes"], float, "graph: input_bytes"),
                              build(GraphMeta, d.get("meta", {}), "graph: meta", PlanFormatError), runtime)
        except (KeyError, TypeError) as e:
            raise PlanFormatError(f"graph: missing or malformed field ({e})") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @staticmethod
    def from_json(text: str, legacy_modules: Mapping[str, str] | None = None) -> LayerGraph:
        try:
            return LayerGraph.from_dict(json.loads(text), legacy_modules)
        except json.JSONDecodeError as e:
            raise PlanFormatError(f"graph: not JSON ({e.msg} at line {e.lineno})") from None
        except RecursionError:
            raise PlanFormatError("graph: nested too deeply; not a layer graph") from None


Graphs = LayerGraph | tuple[LayerGraph, ...]
"""What prices a stage's layers: one graph for every layer, or one per layer, bottom first (a stack of layer
kinds, `lynx.stack`: DeepSeek-V3's dense first layers below its MoE layers; docs/decisions/0221)."""


def per_layer(graphs: Graphs, n: int) -> tuple[LayerGraph, ...]:
    """The graph of each of `n` layers."""
    if isinstance(graphs, LayerGraph):
        return (graphs,) * n
    if len(graphs) != n:
        raise ValueError(f"{len(graphs)} layer graphs for {n} layers")
    return graphs


def first_graph(graphs: Graphs) -> LayerGraph:
    """A representative graph (the bottom layer's): for what every kind shares (dtype, runtime costs)."""
    return graphs if isinstance(graphs, LayerGraph) else graphs[0]


def graphs_key(graphs: Graphs) -> object:
    """A memo key for `graphs` (objects, not contents): a graph's id, or the ids of a per-layer tuple. Memos keep
    the graphs beside their entry and check them with `same_graphs` (an id may be reused once freed)."""
    return id(graphs) if isinstance(graphs, LayerGraph) else tuple(id(g) for g in graphs)


def same_graphs(a: Graphs, b: Graphs) -> bool:
    if isinstance(a, LayerGraph) or isinstance(b, LayerGraph):
        return a is b
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def slice_graphs(graphs: Graphs, lo: int, hi: int) -> Graphs:
    """The graphs of layers lo .. hi - 1 (one graph stays one graph)."""
    return graphs if isinstance(graphs, LayerGraph) else graphs[lo:hi]


@functools.lru_cache(maxsize=4096)
def stage_graphs(kind_graphs: tuple[tuple[str, LayerGraph], ...], kinds: tuple[str, ...]) -> tuple[LayerGraph, ...]:
    """One graph per layer by its kind (`kind_graphs`: kind -> graph); the same tuple object for the same stage,
    so the simulator's and the memory model's memos (keyed by graph objects) hit across calls."""
    by = dict(kind_graphs)
    return tuple(by[k] for k in kinds)


def kind_runs(graph: Graphs, n: int) -> tuple[tuple[LayerGraph, ...], tuple[int, ...]]:
    """A stage's layers as runs of one graph each, bottom first: (the runs' graphs, their layer counts). One
    graph: one run of all `n` layers (the paper's HEU); one graph per layer: a run per kind change."""
    gs = per_layer(graph, n)
    graphs: list[LayerGraph] = []
    counts: list[int] = []
    for g in gs:
        if graphs and graphs[-1] is g:
            counts[-1] += 1
        else:
            graphs.append(g)
            counts.append(1)
    return tuple(graphs), tuple(counts)


_P = ParamSpec("_P")
_R = TypeVar("_R")
MEMO_ENTRIES = 4096
"""Entries one `per_graph` memo keeps before it starts again (a search touches a few hundred graphs)."""


def per_graph(fn: Callable[Concatenate[LayerGraph, _P], _R]) -> Callable[Concatenate[LayerGraph, _P], _R]:
    """Memoize a pure function of a graph (and hashable arguments) by the graph's identity: hashing a graph hashes
    every op, and a search asks the same policy or memory question of one graph object thousands of times. Each
    entry holds its graph, so the id it is keyed by cannot be reused while it is cached; the result must be
    immutable (the callers' are frozen dataclasses)."""
    memo: dict[tuple[object, ...], tuple[LayerGraph, _R]] = {}

    @functools.wraps(fn)
    def wrapper(graph: LayerGraph, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        key = (id(graph), args, tuple(kwargs.items()))
        hit = memo.get(key)
        if hit is not None and hit[0] is graph:
            return hit[1]
        out = fn(graph, *args, **kwargs)
        if len(memo) >= MEMO_ENTRIES:
            memo.clear()
        memo[key] = (graph, out)
        return out

    return wrapper
