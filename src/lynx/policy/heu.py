"""Lynx-HEU: the per-layer recomputation ILP of the paper (sec. 4.2, eqs. 2-9), solved with HiGHS.

One policy for ONE transformer layer is chosen and applied to every layer of a stage. Notation follows
the paper (docs/heu.md has every constraint and what is approximated):

* ``S_i``      - op i's output (and mask) is kept from its forward until its backward (eq. 3's S).
* ``R_{t,i}``  - op i is recomputed in phase t (1, 2 forward windows of a later forward; 3, 4 backward
  windows of the layer above; 5 on demand). Written so that ``S_i + sum_t R_{t,i} = 1`` for ops some
  backward reads: this linearizes the paper's ``(1 - S_i) * R_{t,i}`` products in eqs. (2), (5), (9).
* ``F_i``      - op i is freed and never recomputed: only for ops no backward reads (an extension: the
  paper recomputes every op; an unneeded one need not be).
* ``C_i``      - op i's forward (= recompute) time; ``M_i`` its keep bytes; ``CTime_t`` the window idle time.

The objective is the stage's on-critical-path recomputation per micro-batch (eq. 2 summed over the stage's
layers), plus the top layer's phase 3/4 work, which has no layer above it to hide in and so runs on demand
(the simulator charges it the same way).

Beyond the paper, with ``HeuOptions.offload`` (a host link), a third state (docs/offload.md):

* ``O_i``      - op i's kept output is offloaded: copied to the host after the forward, reloaded before the
  backward (``O_i <= S_i``); ``V = sum_l sum_i O_i M_i`` the bytes one micro-batch of the stage moves each way;
* ``E``        - the copy time per micro-batch the stage cannot hide (`lynx.policy.offload`), in the objective.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from lynx.cost.memory import layer_memories, stage_floor_bytes, stage_peak_bytes
from lynx.cost.pricing import fsdp_window, op_recompute_cost
from lynx.decisions import (
    BWD_PHASES,
    FWD_PHASES,
    FsdpCharge,
    LayerPolicy,
    Phase,
    RecomputePolicy,
    SolveStats,
    StageContext,
    validate_layer_policy,
)
from lynx.errors import InfeasibleError
from lynx.graph import LAYER_INPUT, Graphs, LayerGraph, first_graph, kind_runs, per_layer, stage_graphs
from lynx.milp import Backend, HighsOptions, Milp, MilpSolution, solve_concurrently
from lynx.policy.heu_objective import cooldown_weight as cooldown_weight
from lynx.policy.heu_objective import critical_recompute as critical_recompute
from lynx.policy.heu_objective import recompute_time as recompute_time
from lynx.policy.heu_objective import window_caps as window_caps
from lynx.policy.offload import (
    OffloadLink,
    chunk_exposure_rows,
    chunk_in_flight,
    exposure_rows,
    stage_cycle,
    stage_exposed_copy,
)

GiB = float(1 << 30)
PHASES: tuple[Phase, ...] = tuple(Phase)
OBJ_SCALE = 1e6
"""The objective is built in microseconds: HiGHS stops at an absolute gap of 1e-6, which in seconds would
be a large fraction of a recomputation-time objective of a few milliseconds."""
OFFLOAD_MIP_GAP = 1e-3
"""The relative gap the offloading models stop at. With per-chunk offload sets an interleaved stage's model of
~100 binaries can take HiGHS seconds, up to the 10 s limit, to close its last 1e-5 of gap (the configuration
search solves hundreds: decision 0145); at 1e-3 the same models close in tens of milliseconds, their optimum at
most 1e-3 of the stage's critical time away (about a microsecond per micro-batch), which can cost the tie-break,
never a window."""
OFFLOAD_MAX_NODES = 10_000
"""The branch-and-bound nodes an offloading model may explore before HiGHS returns its incumbent (decision 0252):
a work limit, so the answer is the same on every machine, where the 10 s time limit it stands in front of made one
of the Qwen3-235B / 256 H100 search's models answer by the machine's speed. Capped models keep the incumbent HiGHS
had (within the gap of the optimum on the models measured; the slowest capped one takes about 2 s)."""
OFFLOAD_HIGHS_OPTIONS: HighsOptions = (("mip_heuristic_run_rins", False), ("mip_heuristic_run_rens", False),
                                       ("mip_max_nodes", OFFLOAD_MAX_NODES))
"""HiGHS options of the offloading models: without the RINS and RENS sub-MIP heuristics, at most `OFFLOAD_MAX_NODES`
nodes (decision 0252). Most of
these models close at the root or within a hundred nodes, where the sub-MIPs were much of their time; one of the
70B / 64 search took seconds and 44,830 nodes to prove an incumbent it had at 0.1 s. Re-solved side by side
(`benchmarks/offload_milp.py`), the search's 304 offloading models take 0.67x the HiGHS time without the two, the
slowest 1.13 s instead of 8.09 s, 33 of them stopping at another solution within the gap (8.9e-4 at most); the
searches' picks are unchanged."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HeuOptions:
    """Knobs of Lynx-HEU."""

    cooldown_overlap: bool = True
    """Hide cool-down phase-1/2 work in pipeline stalls (paper sec. 4.2, second optimization). When off,
    the cool-down micro-batches' phase-1/2 work is priced as on-demand in the objective."""
    tie_break: float = 1e-3
    """Weight of total recomputation time in the objective: among policies with equal critical time,
    prefer recomputing less (less energy, less exposure to window-time misprediction)."""
    time_limit_s: float = 10.0
    mip_gap: float = 1e-6
    """HiGHS's relative gap: 1e-6 proves the tie-break too. The offloading models use `OFFLOAD_MIP_GAP`."""
    highs_options: HighsOptions = ()
    """More HiGHS options (`Milp.solve`): the offloading models use `OFFLOAD_HIGHS_OPTIONS`."""
    backend: Backend = "auto"
    skip_when_all_fit: bool = True
    """Answer without an ILP when keeping every activation fits (objective 0 is then optimal)."""
    method: str = "lynx-heu"
    offload: OffloadLink | None = None
    """The per-GPU host link: offloading is a third choice per op (None: keep or recompute only, the paper's
    HEU). Interleaved stages get one offload set per model chunk (`LayerVars.chunk_O`)."""


@dataclass(frozen=True, slots=True)
class LayerVars:
    """Variable handles of one layer policy in a Milp: ``S[i]``, ``R[i][phase]``, ``F[i]``."""

    S: dict[str, int]
    R: dict[str, dict[Phase, int]]
    F: dict[str, int]
    O: dict[str, int] = field(default_factory=dict)  # noqa: E741 (the paper's notation, as S, R, F)
    """Offload variables (only with `HeuOptions.offload`)."""
    chunk_O: list[dict[str, int]] = field(default_factory=list)  # noqa: N815
    """Interleaved stages: offload variables per model chunk (chunk 0 first; empty for a chunk whose in-flight
    count never exceeds one, where offloading frees nothing); `O` is then empty."""


def allowed_phases(graph: LayerGraph, name: str, has_fwd_windows: bool,
                   caps: dict[Phase, float] | None = None) -> tuple[Phase, ...]:
    # eq. (6): a comm op is never recomputed inside a window (no collective inside a collective's window);
    # the last stage / PP = 1 variant has no forward windows (sec. 4.2, first optimization);
    # eq. (5) alone already rules out a window shorter than the op: no variable is made for it.
    op = graph.op(name)
    if op.is_comm:
        return (Phase.ON_DEMAND,)
    out = PHASES if has_fwd_windows else (Phase.BWD_MLP, Phase.BWD_ATTN, Phase.ON_DEMAND)
    if caps is not None:
        c = op_recompute_cost(graph, name)
        out = tuple(t for t in out if t == Phase.ON_DEMAND or c <= caps[t] * (1 + 1e-9))
    return out


def add_layer_vars(m: Milp, graph: LayerGraph, has_fwd_windows: bool, tag: str = "",
                   caps: dict[Phase, float] | None = None) -> LayerVars:
    """Variables and the per-layer constraint groups (3), (4), (6) of one layer policy."""
    needed = graph.needed()
    S: dict[str, int] = {}
    R: dict[str, dict[Phase, int]] = {}
    F: dict[str, int] = {}
    for op in graph.ops:
        n = op.name
        S[n] = m.binary(f"S{tag}[{n}]")
        R[n] = {t: m.binary(f"R{tag}[{int(t)},{n}]") for t in allowed_phases(graph, n, has_fwd_windows, caps)}
        if n not in needed:
            F[n] = m.binary(f"F{tag}[{n}]")
        # (3) every op some backward reads is kept or recomputed exactly once:
        #     S_i + sum_t R_{t,i} = 1            (+ F_i for ops no backward reads)
        row = {S[n]: 1.0, **{v: 1.0 for v in R[n].values()}}
        if n in F:
            row[F[n]] = 1.0
        m.eq(row, 1.0)
    # (3b) an op no backward reads is kept only as a source for recomputing a consumer (otherwise the
    #      bytes are wasted): S_i <= sum_{c reads i} sum_t R_{t,c}
    for n in F:
        consumers = [c.name for c in graph.ops if n in c.inputs]
        m.le({S[n]: 1.0, **{v: -1.0 for c in consumers for v in R[c].values()}}, 0.0)
    # (4) dependencies, for every input j of i (the layer input is always stored):
    #     sum_{t' <= t} R_{t',i} <= sum_{t' <= t} R_{t',j} + S_j     ("i recomputed by phase t => j
    #     available by phase t"). On integer points this is the paper's R_{t,i} <= sum_{t'<=t} R_{t',j} + S_j
    #     (i is recomputed once); its LP relaxation is tighter: ~20% faster solves, same optima (measured).
    #     Same phase is allowed: inputs precede i in forward order.
    for op in graph.ops:
        for j in op.inputs:
            if j == LAYER_INPUT:
                continue
            for t in R[op.name]:
                row = {r2: 1.0 for t2, r2 in R[op.name].items() if t2 <= t}
                row[S[j]] = -1.0
                for t2, r2 in R[j].items():
                    if t2 <= t:
                        row[r2] = row.get(r2, 0.0) - 1.0
                m.le(row, 0.0)
    return LayerVars(S, R, F)


def add_offload_vars(m: Milp, graph: LayerGraph, lv: LayerVars, tag: str = "") -> None:
    """The third state's per-layer constraint groups (O1), (O2). Only outputs some backward reads are offload
    candidates (an output kept only as a recomputation source is needed in a window, before any reload)."""
    needed = graph.needed()
    for op in graph.ops:
        n = op.name
        if n not in needed or graph.keep_bytes(n) <= 0:
            continue
        lv.O[n] = m.binary(f"O{tag}[{n}]")
        # (O1) only a kept output is offloaded: O_i <= S_i
        m.le({lv.O[n]: 1.0, lv.S[n]: -1.0}, 0.0)
    # (O2) phase-1/2 recomputation runs in a later forward, before the reload: an op recomputed there reads no
    #      offloaded input: R_{t,c} + O_j <= 1 for t in 1, 2 and every input j of c
    for op in graph.ops:
        for j in op.inputs:
            if j in lv.O:
                for t in FWD_PHASES:
                    if t in lv.R[op.name]:
                        m.le({lv.R[op.name][t]: 1.0, lv.O[j]: 1.0}, 1.0)


def add_offload_stage(m: Milp, graph: LayerGraph, groups: list[Group], ctx: StageContext,
                      link: OffloadLink, tie: float, price: bool = True) -> None:
    """The third state's stage-wide rows: host memory (O4) and, with `price`, the exposed copy time (O3) in the
    objective."""
    if groups[0][0].chunk_O:
        add_offload_chunks(m, graph, groups[0][0].chunk_O, ctx, link, tie, price)
        return
    volume = {lv.O[n]: c * graph.keep_bytes(n) for lv, c in groups for n in lv.O}
    if not volume:
        return
    # (O4) host memory: every in-flight micro-batch's offloaded bytes fit the GPU's share of the node's host
    #      memory: f * V <= H
    m.le({v: ctx.in_flight * x for v, x in volume.items()}, link.host_bytes)
    if not price:
        return
    t_fwd, t_bwd = stage_cycle(graph, ctx.num_layers, ctx.subtract_wgrad)
    E = m.var("E", cost=OBJ_SCALE)
    # (O3) E >= a V - b for each copy bound (throughput of each stream per 1F1B cycle T_F + T_B, or of the one
    #      shared engine; latency: the round trip within the f - 1 cycles micro-batch j waits on stage s,
    #      f = min(p - s, m), plus the layer-wise overlap (n - 1) / n of one cycle): sum a M_i O_i - E <= b
    for a, b in exposure_rows(link, t_fwd, t_bwd, ctx.in_flight, ctx.num_layers):
        m.le({**{v: a * x for v, x in volume.items()}, E: -1.0}, b)
    # tie-break: among equal critical times prefer moving fewer bytes (as for recomputation)
    for v, x in volume.items():
        m.add_cost(v, tie * x / link.d2h_Bps * OBJ_SCALE)


def add_offload_chunks(m: Milp, graph: LayerGraph, chunk_O: list[dict[str, int]], ctx: StageContext,
                       link: OffloadLink, tie: float, price: bool) -> None:
    """(O3), (O4) for an interleaved stage, chunk k moving V_k = n_k sum_i O_ki M_i per micro-batch:
    host memory at each live vector v, sum_k v_k V_k <= H (`memory.host_bytes`); the exposed copy time
    E >= sum_k w_k V_k - b for the throughput rows on V = sum_k V_k and each chunk's round trip
    (`policy.offload.chunk_exposure_rows`, which the simulator prices too)."""
    volume = [{v: n * graph.keep_bytes(x) for x, v in o.items()} for o, n in zip(chunk_O, ctx.chunk_layers,
                                                                                 strict=True)]
    if not any(volume):
        return
    for vec in ctx.live_vectors or (ctx.chunk_in_flight,):
        m.le({v: f * x for f, vol in zip(vec, volume, strict=True) for v, x in vol.items()}, link.host_bytes)
    if not price:
        return
    t_fwd, t_bwd = stage_cycle(graph, ctx.num_layers, ctx.subtract_wgrad)
    E = m.var("E", cost=OBJ_SCALE)
    for ws, b in chunk_exposure_rows(link, t_fwd, t_bwd, chunk_in_flight(ctx), ctx.chunk_layers):
        row = {v: w * x for w, vol in zip(ws, volume, strict=True) if w for v, x in vol.items()}
        if row:
            m.le({**row, E: -1.0}, b)
    for vol in volume:
        for v, x in vol.items():
            m.add_cost(v, tie * x / link.d2h_Bps * OBJ_SCALE)


def add_windows(m: Milp, graph: LayerGraph, lv: LayerVars, subtract_wgrad: bool) -> None:
    # (5) window capacity: sum_i R_{t,i} C_i <= CTime_t for t in 1..4; CTime_3,4 is the idle part only
    #     (comm - wgrad when Megatron already overlaps the weight-gradient GEMM, ctx.subtract_wgrad).
    for t, cap in window_caps(graph, subtract_wgrad).items():
        row = {r[t]: op_recompute_cost(graph, n) for n, r in lv.R.items() if t in r}
        if row:
            m.le(row, cap * (1 + 1e-9))


def memory_terms(graph: LayerGraph, lv: LayerVars) -> dict[str, dict[int, float]]:
    """Linear expressions (bytes per layer, per micro-batch) of the memory model's terms (memory.py)."""
    keep = {lv.S[n]: graph.keep_bytes(n) for n in lv.S}

    def phase_sum(phases: tuple[Phase, ...]) -> dict[int, float]:
        return {r[t]: graph.keep_bytes(n) for n, r in lv.R.items() for t in phases if t in r}

    return {"kept": keep, "fwd": phase_sum(FWD_PHASES), "bwd": phase_sum(BWD_PHASES),
            "od": phase_sum((Phase.ON_DEMAND,))}


Group = tuple[LayerVars, int]
"""A run of identical layers: the policy's variables and how many layers use it (bottom run first)."""


def memory_rows(graph: LayerGraph | tuple[LayerGraph, ...], groups: list[Group], ctx: StageContext
                ) -> list[tuple[dict[int, float], float]]:
    """(7)-(9) made exact for memory.linear_peak_bytes (an upper bound of the lifetime rule,
    memory.stage_peak_bytes, which checks the result); each row reads ``expr + offset <= A`` with A the
    stage's activation budget (budget minus static and non-layer terms):

    N_batch * sum_l (M_in + sum_i S_i M_i)                                  (8), M_fwd
      + sum_l sum_i (R_1i + R_2i) M_i                                       (9), M_fwd_comm of one batch
      + max(forward working set, backward working set)                     (7)

    The max becomes one row per term. Forward working set of a layer = what it produces and drops
    (full - retained). Backward working set of layer l = its on-demand and phase-3/4 tensors plus the
    phase-3/4 tensors of layer l - 1, which l's backward windows rebuild while l's backward runs.
    """
    gg = _group_graphs(graph, len(groups))
    terms = [memory_terms(x, lv) for x, (lv, _) in zip(gg, groups, strict=True)]
    # micro-batches in flight x layers, per group: the schedule's facts (one chunk: in_flight * count;
    # interleaved, one group: each chunk's in-flight count times its layers; several groups: the largest)
    held = [ctx.layer_microbatches() if len(groups) == 1 else ctx.in_flight * c for _, c in groups]
    base: dict[int, float] = {}
    for x, t, (lv, c), h in zip(gg, terms, groups, held, strict=True):
        _acc(base, {v: h * b for v, b in t["kept"].items()})
        _acc(base, {v: c * b for v, b in t["fwd"].items()})  # empty without forward windows
        # (8') an offloaded output is on the device for one micro-batch of the stage (being copied out, or
        #      reloaded for its backward), not for each in flight: - (f - 1) * c * sum_i O_i M_i
        _acc(base, {v: -(ctx.in_flight - 1) * c * x.keep_bytes(n) for n, v in lv.O.items()})
    offset = sum(h * x.input_bytes for h, x in zip(held, gg, strict=True))

    # R_out x out_bytes: a restored layer output exists whole beside its restoration (keep_bytes counts its mask
    # only; lynx.cost.lifetime's transient sample), as memory.linear_peak_bytes counts it
    def r_out(g: int, phases: tuple[Phase, ...]) -> dict[int, float]:
        x, lv = gg[g], groups[g][0]
        out_b = x.op(x.output_op).out_bytes
        return {v: out_b for p, v in lv.R.get(x.output_op, {}).items() if p in phases}

    own_ph = (*BWD_PHASES, Phase.ON_DEMAND)
    fwd_out: dict[int, float] = {}
    for g in range(len(groups)):
        _acc(fwd_out, r_out(g, FWD_PHASES))
    rows: list[tuple[dict[int, float], float]] = []
    for g, t in enumerate(terms):
        # forward working set of a layer of group g: full - M_in - sum_i S_i M_i
        row = dict(base)
        _acc(row, {v: -x for v, x in t["kept"].items()})
        _acc(row, fwd_out)
        rows.append((row, offset + gg[g].full_activation_bytes() - gg[g].input_bytes))
        # backward working set of group g's bottom layer (the layer below is group g-1's top, if any)
        row = dict(base)
        _acc(row, t["od"])
        _acc(row, t["bwd"])
        _acc(row, r_out(g, own_ph))
        if g > 0:
            _acc(row, terms[g - 1]["bwd"])
            _acc(row, r_out(g - 1, BWD_PHASES))
        rows.append((row, offset))
        if groups[g][1] >= 2:  # a layer of group g above another of group g
            row = dict(base)
            _acc(row, t["od"])
            _acc(row, {v: 2.0 * x for v, x in t["bwd"].items()})
            _acc(row, r_out(g, own_ph))
            _acc(row, r_out(g, BWD_PHASES))
            rows.append((row, offset))
    return rows


def _group_graphs(graph: LayerGraph | tuple[LayerGraph, ...], n: int) -> tuple[LayerGraph, ...]:
    """The graph of each of `n` groups (one graph: every group's)."""
    return (graph,) * n if isinstance(graph, LayerGraph) else graph


def _acc(row: dict[int, float], more: dict[int, float]) -> None:
    for v, c in more.items():
        row[v] = row.get(v, 0.0) + c


def add_objective(m: Milp, graph: LayerGraph | tuple[LayerGraph, ...], groups: list[Group], lam: float, tie: float,
                  tops: int = 1, fsdp_win: float = 0.0) -> None:
    """(2) minimize sum_l sum_i R_{5,i} C_i over the stage's layers, plus the top layer's R_{3,i} + R_{4,i}
    (no layer above it lends its backward windows; `tops` such layers, one per model chunk), plus lam *
    phase-1/2 work (the cool-down share when stalls may not hide it), plus the tie-break on all
    recomputation. Under FSDP a layer's on-demand work hides in its window `fsdp_win` (`pricing.fsdp_window`):
    the layer pays Y >= sum_i R_{5,i} C_i - W, Y >= 0, instead."""
    gg = _group_graphs(graph, len(groups))
    for g, (lv, count) in enumerate(groups):
        top = g == len(groups) - 1
        if fsdp_win > 0:
            y = m.var(f"Y{g}", cost=count * OBJ_SCALE)
            m.le({**{r[Phase.ON_DEMAND]: op_recompute_cost(gg[g], n) for n, r in lv.R.items()
                     if Phase.ON_DEMAND in r}, y: -1.0}, fsdp_win)
        for n, r in lv.R.items():
            c = op_recompute_cost(gg[g], n)
            for t, v in r.items():
                w = tie * count
                if t == Phase.ON_DEMAND and fsdp_win <= 0:
                    w += count
                elif t in BWD_PHASES and top:
                    w += float(tops)
                elif t in FWD_PHASES:
                    w += lam * count
                m.add_cost(v, w * c * OBJ_SCALE)


def extract(graph: LayerGraph, sol: MilpSolution, lv: LayerVars) -> LayerPolicy:
    keep = frozenset(n for n, v in lv.S.items() if sol.is_one(v))
    rec = tuple((n, t) for n in graph.names for t, v in lv.R[n].items() if sol.is_one(v))
    off = frozenset(n for n, v in lv.O.items() if sol.is_one(v))
    return LayerPolicy(keep=keep, recompute=rec, offload=off)


def build_model(graph: Graphs, ctx: StageContext, opts: HeuOptions, counts: tuple[int, ...] = (),
                min_memory: bool = False, floor: bool = False) -> tuple[Milp, list[LayerVars], int]:
    """The HEU model for runs of identical layers (`counts`, bottom first; default: one run of all the
    stage's layers, the paper's HEU). With `min_memory`, the objective is the activation budget it needs
    (returned handle z) instead of recomputation time; with `floor`, only what the simulator charges on the
    critical path whatever the schedule (`demand_floor`): the on-demand work beyond an FSDP window and the exposed
    copy time, without the top chunks' phase-3/4 work, the cool-down weight and the tie-break. `graph` per layer
    (a stage of several layer kinds): one run, with its own policy, per kind change (`kind_runs`); the runs share
    the stage's memory rows."""
    if not isinstance(graph, LayerGraph):
        return _build_runs(graph, ctx, opts, min_memory)
    counts = counts or (ctx.num_layers,)
    m = Milp()
    caps = window_caps(graph, ctx.subtract_wgrad)
    lvs = [add_layer_vars(m, graph, ctx.has_fwd_windows, tag=f"{g}" if len(counts) > 1 else "", caps=caps)
           for g in range(len(counts))]
    # offloading frees (f - 1) micro-batches' bytes: nothing with one in flight (the last stage), so no variables;
    # interleaved stages (one policy for the rank's layers) get one offload set per chunk
    chunked = bool(ctx.chunk_layers) and len(counts) == 1 and opts.offload is not None
    link = opts.offload if (chunked or not ctx.chunk_layers) and ctx.in_flight > 1 else None
    for g, lv in enumerate(lvs):
        add_windows(m, graph, lv, ctx.subtract_wgrad)
        if link is not None and not chunked:
            add_offload_vars(m, graph, lv, tag=f"{g}" if len(counts) > 1 else "")
    if link is not None and chunked:
        for k, f in enumerate(chunk_in_flight(ctx)):
            view = LayerVars(lvs[0].S, lvs[0].R, lvs[0].F)
            if f > 1:
                add_offload_vars(m, graph, view, tag=f"c{k}")
            lvs[0].chunk_O.append(view.O)
    groups = list(zip(lvs, counts, strict=True))
    z = m.var("A", lb=-math.inf, cost=1.0) if min_memory else -1
    for row, off in _all_memory_rows(graph, groups, ctx, m):
        if min_memory:
            m.le({**row, z: -1.0}, -off)
        else:
            m.le(row, ctx.activation_budget_bytes - off)
    tie = 0.0 if floor else opts.tie_break
    if not min_memory:
        add_objective(m, graph, groups, 0.0 if floor else cooldown_weight(ctx, opts.cooldown_overlap), tie,
                      0 if floor else ctx.num_chunks, fsdp_window(graph, ctx))
    if link is not None:
        # the smallest budget: the host memory still binds, the copy time does not matter
        add_offload_stage(m, graph, groups, ctx, link, tie, price=not min_memory)
    return m, lvs, z


def _build_runs(graphs: tuple[LayerGraph, ...], ctx: StageContext, opts: HeuOptions, min_memory: bool
                ) -> tuple[Milp, list[LayerVars], int]:
    """HEU over a stage of several layer kinds: one layer policy per run of one kind (`kind_runs`), each with
    its kind's ops, windows and costs, under the stage's shared memory rows. A run's phase-3/4 work hides in
    the backward windows of the layer above; below another kind's run they are the smaller of the two kinds'
    (a bound, the simulator charges the exact overflow). No offloading (not priced for several kinds)."""
    gg, counts = kind_runs(graphs, ctx.num_layers)
    m = Milp()
    lvs = []
    for g, x in enumerate(gg):
        caps = window_caps(x, ctx.subtract_wgrad)
        if g + 1 < len(gg):
            above = window_caps(gg[g + 1], ctx.subtract_wgrad)
            caps = {t: min(c, above[t]) if t in BWD_PHASES else c for t, c in caps.items()}
        lv = add_layer_vars(m, x, ctx.has_fwd_windows, tag=f"{g}", caps=caps)
        for t, cap in caps.items():  # (5) window capacity with the run's caps
            row = {r[t]: op_recompute_cost(x, n) for n, r in lv.R.items() if t in r}
            if row:
                m.le(row, cap * (1 + 1e-9))
        lvs.append(lv)
    groups = list(zip(lvs, counts, strict=True))
    z = m.var("A", lb=-math.inf, cost=1.0) if min_memory else -1
    for row, off in memory_rows(gg, groups, ctx):
        if min_memory:
            m.le({**row, z: -1.0}, -off)
        else:
            m.le(row, ctx.activation_budget_bytes - off)
    if not min_memory:
        add_objective(m, gg, groups, cooldown_weight(ctx, opts.cooldown_overlap), opts.tie_break, ctx.num_chunks,
                      min(fsdp_window(x, ctx) for x in gg))  # under FSDP the kinds' smallest window (a bound)
    return m, lvs, z


D_UNIT = float(2**30)
"""Bytes per unit of `_all_memory_rows`' variable D. In bytes (a coefficient of 1 beside coefficients of ~1e10) the
stage MILPs took HiGHS 1.6x as long (benchmarks/results/d_units_milp.json), and `Milp.row_scaled` (the LP floors)
left it below HiGHS's `small_matrix_value` (1e-9), which dropped it: the floor was of another model (decision
0271)."""


def _all_memory_rows(graph: LayerGraph, groups: list[Group], ctx: StageContext, m: Milp
                     ) -> list[tuple[dict[int, float], float]]:
    """`memory_rows`, and for an interleaved stage with per-chunk offload variables its rows at every live vector
    v of the schedule (the peak is the largest; `memory.held_bytes`): the layers' kept bytes weighted by v
    (`memory_rows` on the context with v alone) and chunk k's offloaded bytes on the device once instead of v_k
    times: - (v_k - 1) * n_k * sum_i O_ki M_i. The vectors change only the held part, which every row shares, so
    one continuous D >= held(v) - held(v0) for each v, added to v0's rows, stands for all of them (exact, and
    rows + vectors instead of rows x vectors)."""
    lv = groups[0][0]
    if not any(lv.chunk_O):
        return memory_rows(graph, groups, ctx)
    vectors = ctx.live_vectors or (ctx.chunk_in_flight,)
    d = m.var("D", lb=-math.inf)  # in GiB (`D_UNIT`): its coefficient in a bytes row is not lost to scaling
    held: list[tuple[dict[int, float], float]] = []  # (held(v) less the rows' shared part, its offset) per v
    first: list[tuple[dict[int, float], float]] = []
    for vec in vectors:
        rows = memory_rows(graph, groups, replace(ctx, live_vectors=(vec,)))
        row0 = dict(rows[0][0])
        _acc(row0, {v: -(f - 1) * n * graph.keep_bytes(x) for f, n, o in zip(vec, ctx.chunk_layers, lv.chunk_O,
                                                                              strict=True) for x, v in o.items()})
        held.append((row0, rows[0][1]))
        first = first or rows
    # held(v) - held(v0) <= D for every v (v0 itself: D >= 0)
    for row0, off0 in held:
        diff = dict(row0)
        _acc(diff, {v: -x for v, x in held[0][0].items()})
        _acc(diff, {d: -D_UNIT})
        m.le(diff, held[0][1] - off0)
    # v0's rows with its offload terms and D: row_r(v0) + extra(v0) + D <= A - offset_r(v0)
    extra0 = dict(held[0][0])
    _acc(extra0, {v: -x for v, x in first[0][0].items()})
    out = []
    for row, off in first:
        row = dict(row)
        _acc(row, extra0)
        _acc(row, {d: D_UNIT})
        out.append((row, off))
    return out


def min_budget_bytes(graph: Graphs, ctx: StageContext, opts: HeuOptions = HeuOptions()) -> float:
    """The smallest budget for which some HEU policy fits this stage: the same ILP, minimizing the peak."""
    m, _, z = build_model(graph, ctx, opts, min_memory=True)
    sol = m.solve(opts.time_limit_s, opts.mip_gap, backend=opts.backend,
                  highs_options=opts.highs_options)
    if not sol.has_solution:
        return math.inf
    return ctx.budget_bytes - ctx.activation_budget_bytes + sol.value(z)


FLOOR_MARGIN = 1e-3
"""`demand_floor` multiplies the relaxation's optimum by 1 - this: HiGHS solves it within its tolerances on rows in
bytes (up to ~1e11) beside coefficients in microseconds."""


def demand_floor(ctx: StageContext, graph: Graphs, opts: HeuOptions) -> float:
    """A lower bound, in seconds per micro-batch summed over the stage's layers, on the on-demand recomputation of
    any policy the stage's HEU model admits, beyond what an FSDP window hides, plus its offload copies' exposed
    time: the model's LP relaxation with that work as its only cost. The simulator charges at least
    that before the layers' backwards (`cost.pricing.layer_recompute`: phase 5, plus what overflows a window;
    `policy.offload.stage_exposed_copy`: the model's own exposure rows), so the search adds it to a screen's time
    bound (`search.tree.Frontier.screen_bound`). Policies over several runs of layers (`counts`) average into
    a feasible point of the one-run model (its rows are linear in the policy, or the largest over the runs), so the
    floor holds for them too. 0.0 where none is known: a stage of several layer kinds, a model refused before any
    solve (nothing fits: the planner says so), a relaxation HiGHS does not end optimal."""
    if not isinstance(graph, LayerGraph):
        return 0.0
    m, _, _ = build_model(graph, ctx, opts, floor=True)
    if m.contradiction:
        return 0.0
    m.integer = [False] * m.num_variables
    m = m.row_scaled()  # bytes beside seconds: unscaled, HiGHS ends some of these LPs in error or at its limit
    for options in ((), (("presolve", "off"),)):  # presolve's reductions can end a badly scaled LP in error
        sol = m.solve(opts.time_limit_s, 1e-6, highs_options=options)
        if sol.status == "optimal":
            return max(0.0, sol.objective) / OBJ_SCALE * (1.0 - FLOOR_MARGIN)
    return 0.0


def _stats(sol: MilpSolution, msg: str = "") -> SolveStats:
    return SolveStats(solver=sol.backend, status=sol.status, objective=sol.objective / OBJ_SCALE,
                      solve_time_s=sol.solve_time_s, num_variables=sol.num_variables,
                      num_constraints=sol.num_constraints, mip_gap=sol.mip_gap, message=msg)


def infeasible(graph: Graphs | Callable[[StageContext], Graphs], ctxs: list[StageContext], opts: HeuOptions
               ) -> InfeasibleError:
    mins = tuple(min_budget_bytes(graph(c) if callable(graph) else graph, c, opts) for c in ctxs)
    parts = ", ".join(f"stage {c.stage} ({c.num_layers} layers) needs {b / GiB:.2f} GiB" if math.isfinite(b) else
                      f"stage {c.stage} ({c.num_layers} layers) fits no budget the solver could find (its "
                      "activations are too large to bound; reduce --seq-len, --micro-batch or the model)"
                      for c, b in zip(ctxs, mins, strict=True))
    budget = ctxs[0].budget_bytes / GiB if ctxs else 0.0
    return InfeasibleError(f"no recomputation policy fits the budget of {budget:.2f} GiB: {parts}", mins)


def solve_stage(ctx: StageContext, graph: Graphs, opts: HeuOptions, counts: tuple[int, ...] = (),
                explain: bool = True) -> RecomputePolicy:
    """Solve the HEU model for runs of identical layers (`counts`, bottom first; default one run).

    Raises InfeasibleError when no policy fits; with `explain` it carries the smallest budget that would
    (one more ILP), without it (inside partition search) it is cheap."""
    kruns = kind_runs(graph, ctx.num_layers)
    if not isinstance(graph, LayerGraph):
        counts = kruns[1]
    counts = counts or (ctx.num_layers,)
    if (len(counts) == 1 or not isinstance(graph, LayerGraph)) and opts.skip_when_all_fit:
        keep_all = tuple(LayerPolicy(g.needed()) for g in per_layer(graph, ctx.num_layers))
        # the replay-free floor first: over the budget, the peak is too (`memory.stage_floor_bytes`)
        if stage_floor_bytes(layer_memories(graph, keep_all), ctx) <= ctx.budget_bytes and \
                stage_peak_bytes(graph, keep_all, ctx) <= ctx.budget_bytes:
            # No recomputation fits: objective 0 is the ILP's optimum, no solve needed.
            return RecomputePolicy(opts.method, keep_all, cooldown_overlap=opts.cooldown_overlap,
                                   stats=SolveStats("closed-form", "optimal", message="keeping every "
                                                    "activation fits the budget: nothing to recompute"))
    m, lvs, _ = build_model(graph, ctx, opts, counts)
    sol = m.solve(opts.time_limit_s, opts.mip_gap, backend=opts.backend,
                  highs_options=opts.highs_options)
    if not sol.has_solution:
        if explain:
            raise infeasible(graph, [ctx], opts)
        raise InfeasibleError(f"stage {ctx.stage}: no policy fits ({sol.status})")
    layers: tuple[LayerPolicy, ...] = ()
    run_graphs = kruns[0] if not isinstance(graph, LayerGraph) else (graph,) * len(counts)
    for lv, c, rg in zip(lvs, counts, run_graphs, strict=True):
        lp = extract(rg, sol, lv)
        runs = [(lp, c)]
        if lv.chunk_O:  # interleaved: the policy with each chunk's own offload set
            runs = [(replace(lp, offload=frozenset(x for x, v in o.items() if sol.is_one(v))), n)
                    for o, n in zip(lv.chunk_O, ctx.chunk_layers, strict=True)]
        for lpk, n in runs:
            errs = validate_layer_policy(rg, lpk, ctx.has_fwd_windows)
            if errs:  # a modelling bug, never a user error
                raise AssertionError(f"HEU produced an invalid policy: {errs}")
            layers += (lpk,) * n
    peak = stage_peak_bytes(graph, layers, ctx)
    if peak > ctx.budget_bytes * (1 + 1e-6):
        raise AssertionError(f"HEU policy peaks at {peak / GiB:.3f} GiB, over the budget "
                             f"{ctx.budget_bytes / GiB:.3f} GiB")
    crit = critical_recompute(graph, layers, ctx, opts.cooldown_overlap)
    msg = f"critical recompute {crit * 1e3:.3f} ms per micro-batch"
    if any(lp.offload for lp in layers):
        msg += f", exposed copies {stage_exposed_copy(first_graph(graph), layers, ctx, opts.offload) * 1e3:.3f} ms"
    return RecomputePolicy(opts.method, layers, cooldown_overlap=opts.cooldown_overlap,
                           stats=_stats(sol, msg))


def heu_policy(ctx: StageContext, graph: Graphs, opts: HeuOptions = HeuOptions()) -> RecomputePolicy:
    """Lynx-HEU for one stage: one layer policy for every layer. Raises InfeasibleError (with the
    smallest budget that fits) when none fits."""
    return solve_stage(ctx, graph, opts)


def _quiet_solve(ctx: StageContext, graph: Graphs, opts: HeuOptions) -> RecomputePolicy:
    return solve_stage(ctx, graph, opts, explain=False)


CacheKey = tuple[tuple[str, ...], int, int, int, bool, bool, int, float, tuple[int, ...], int,
                 tuple[tuple[int, ...], ...], FsdpCharge | None]


@dataclass
class HeuCache:
    """HEU results per distinct stage problem within one planning call (the partitioner asks many times).
    Key: (layers, in flight, activation budget in bytes, forward windows, wgrad overlap, cool-down
    micro-batches, cool-down weight, layers per chunk, in flight per chunk, with offloading the live
    vectors, and FSDP's charges), all from the schedule's facts; the value is a policy or the InfeasibleError."""

    graph: LayerGraph
    opts: HeuOptions = field(default_factory=HeuOptions)
    solver: Callable[[StageContext, Graphs, HeuOptions], RecomputePolicy] | None = None
    """None: HEU without the min-budget explanation (cheap infeasibility)."""
    entries: dict[CacheKey, RecomputePolicy | InfeasibleError] = field(default_factory=dict)
    hits: int = 0
    solves: int = 0
    solve_time_s: float = 0.0
    kind_graphs: tuple[tuple[str, LayerGraph], ...] = ()
    """A model of several layer kinds: the graph of each (a stage's `kinds` pick its layers' graphs)."""
    floors: dict[CacheKey, float] = field(default_factory=dict)
    """`demand_floor` per stage problem (the search's screen bounds)."""

    def graphs(self, ctx: StageContext) -> Graphs:
        return stage_graphs(self.kind_graphs, ctx.kinds) if ctx.kinds else self.graph

    def key(self, ctx: StageContext) -> CacheKey:
        return (ctx.kinds, ctx.num_layers, ctx.in_flight, round(ctx.activation_budget_bytes), ctx.has_fwd_windows,
                ctx.subtract_wgrad, ctx.cooldown_count, cooldown_weight(ctx, self.opts.cooldown_overlap),
                ctx.chunk_layers, ctx.layer_microbatches(),
                # per-chunk offloading reads each live vector (memory and host rows)
                ctx.live_vectors or (ctx.chunk_in_flight,) if self.opts.offload is not None else (),
                ctx.fsdp)  # FSDP's window hosts on-demand work (the objective's Y rows, the floors)

    def get(self, ctx: StageContext) -> RecomputePolicy | InfeasibleError:
        k = self.key(ctx)
        if k in self.entries:
            self.hits += 1
            return self.entries[k]
        self.solves += 1
        res, took = self._solve(ctx)
        self.solve_time_s += took
        self.entries[k] = res
        return res

    def get_all(self, ctxs: Sequence[StageContext]) -> list[RecomputePolicy | InfeasibleError]:
        """`get` of each context, the distinct problems not yet solved solved side by side
        (`milp.solve_concurrently`: with `milp.concurrent_solves` on several threads). The answers, solves and
        hits are `get`'s one after the other: the first context of each new key is a solve, the rest hits."""
        keys = [self.key(c) for c in ctxs]
        todo: dict[CacheKey, StageContext] = {}
        for k, c in zip(keys, ctxs, strict=True):
            if k not in self.entries and k not in todo:
                todo[k] = c
        if len(todo) <= 1:
            return [self.get(c) for c in ctxs]
        for k, (res, took) in zip(todo, solve_concurrently([partial(self._solve, c) for c in todo.values()]),
                                  strict=True):
            self.entries[k] = res
            self.solve_time_s += took
        self.solves += len(todo)
        self.hits += len(ctxs) - len(todo)
        return [self.entries[k] for k in keys]

    def _solve(self, ctx: StageContext) -> tuple[RecomputePolicy | InfeasibleError, float]:
        """The stage problem's policy, or why none fits, and the seconds it took."""
        t0 = time.perf_counter()
        res: RecomputePolicy | InfeasibleError
        try:
            res = (self.solver or _quiet_solve)(ctx, self.graphs(ctx), self.opts)
        except InfeasibleError as e:
            res = e
        return res, time.perf_counter() - t0

    def floor(self, ctx: StageContext, cheap: bool = False) -> float:
        """`demand_floor` of the stage problem, once per key; `cheap`: of its relaxation at the one live vector that
        holds the most layer micro-batches (an interleaved stage's model has rows at each of its ~20 vectors; 0.897
        of the full floor at the median stage, benchmarks/results/screen_bounds.json)."""
        if cheap and ctx.live_vectors:
            v = max(ctx.live_vectors, key=lambda vec: sum(f * n for f, n in zip(vec, ctx.chunk_layers, strict=True)))
            ctx = replace(ctx, live_vectors=(v,))
        k = self.key(ctx)
        if k not in self.floors:
            self.floors[k] = demand_floor(ctx, self.graphs(ctx), self.opts)
        return self.floors[k]

