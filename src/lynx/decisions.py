"""The one result type every recomputation algorithm returns, and the context it is solved in.

Every policy algorithm is a function ``(StageContext, LayerGraph) -> RecomputePolicy``. The simulator
(`lynx.simulate`) judges every policy, whoever produced it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from operator import mul
from typing import Any, Literal, get_args

from lynx.errors import PlanFormatError
from lynx.graph import LAYER_INPUT, Graphs, LayerGraph, per_layer
from lynx.schedule import ChunkFacts, facts_1f1b
from lynx.spec import MAX_LAYERS
from lynx.validate import Range, check_field


class Phase(IntEnum):
    """When a dropped output is recomputed (the paper's five phases, design.md made precise)."""

    FWD_ATTN = 1
    """Inside the attention block's forward collective of the *next* forward pass on this stage."""
    FWD_MLP = 2
    """Inside the MLP block's forward collective of the next forward pass."""
    BWD_MLP = 3
    """Inside the MLP block's backward collective of the layer above (it runs just before this one)."""
    BWD_ATTN = 4
    """Inside the attention block's backward collective of the layer above."""
    ON_DEMAND = 5
    """Right before the backward that needs it: on the critical path."""


SolveStatus = Literal["optimal", "time_limit", "feasible", "rule", "infeasible", "no_solution", "error"]
"""How a policy was found: an exact optimum, the best within a time limit, a feasible one, a rule with no
search; the last three only in a MILP's own result (a policy is never built from them)."""

FWD_PHASES = (Phase.FWD_ATTN, Phase.FWD_MLP)
BWD_PHASES = (Phase.BWD_MLP, Phase.BWD_ATTN)
WINDOW_PHASES = FWD_PHASES + BWD_PHASES


@dataclass(frozen=True, slots=True)
class LayerPolicy:
    """Per op of one layer: kept for backward, or recomputed in a phase. Ops in neither are freed after
    forward and nobody needs them."""

    keep: frozenset[str]
    recompute: tuple[tuple[str, Phase], ...] = ()
    input_checkpoint: bool = True
    """False only inside a Megatron ``uniform`` chunk: the layer input is not stored; the chunk's bottom
    layer input is, and the whole chunk is recomputed (every op on demand) before its backward."""
    rerun: frozenset[str] = frozenset()
    """Kept ops whose forward is re-run on demand before their backward, as a Megatron checkpoint re-runs an op
    whose output a later op holds anyway (``--recompute-modules core_attn`` around flash attention: the output
    projection keeps the attention output, the kernel's log-sum-exp is freed and rebuilt by re-running it).
    Their output stays kept, their side state (``mask_bytes``) is freed after forward, and the re-run costs
    the op's forward on the critical path and holds a fresh output and side state while their backward runs.
    Only Megatron's baselines set it; no solver chooses it."""
    offload: frozenset[str] = frozenset()
    """Kept ops whose output (and side state) is offloaded: copied to host memory after the forward, off the
    device from the copy's end until the reload before the layer's backward (docs/offload.md). A subset of
    `keep`: for validation and the backward an offloaded op is kept; only memory and the copy streams
    differ. Empty in every plan written before offloading existed."""

    def phase_of(self, name: str) -> Phase | None:
        for n, p in self.recompute:
            if n == name:
                return p
        return None

    def recomputed(self, phases: tuple[Phase, ...] | None = None) -> tuple[str, ...]:
        return tuple(n for n, p in self.recompute if phases is None or p in phases)

    def to_dict(self, graph: LayerGraph | None = None) -> dict[str, str]:
        """``{op: "keep" | "recompute:<phase>" | "free"}`` in graph order when a graph is given."""
        names = graph.names if graph is not None else tuple(sorted(self.keep | set(self.recomputed())))
        out: dict[str, str] = {} if self.input_checkpoint else {"input": "free"}
        for n in names:
            p = self.phase_of(n)
            out[n] = ("offload" if n in self.offload else "keep+rerun" if n in self.rerun else "keep") \
                if n in self.keep else (f"recompute:{int(p)}" if p is not None else "free")
        return out

    @staticmethod
    def from_dict(d: Mapping[str, str]) -> LayerPolicy:
        keep: set[str] = set()
        rerun: set[str] = set()
        off: set[str] = set()
        rec: list[tuple[str, Phase]] = []
        for n, v in d.items():
            if n == "input":
                continue
            if v in ("keep", "keep+rerun", "offload"):
                keep.add(n)
                if v == "keep+rerun":
                    rerun.add(n)
                if v == "offload":
                    off.add(n)
            elif v.startswith("recompute:"):
                try:
                    rec.append((n, Phase(int(v.split(":", 1)[1]))))
                except ValueError:
                    raise PlanFormatError(f"policy: op {n!r} has an unknown phase in {v!r}") from None
            elif v != "free":
                raise PlanFormatError(f"policy: op {n!r}: expected keep, keep+rerun, offload, recompute:<1-5> or "
                                      f"free, got {v!r}")
        return LayerPolicy(frozenset(keep), tuple(rec), input_checkpoint=d.get("input", "keep") != "free",
                           rerun=frozenset(rerun), offload=frozenset(off))


@dataclass(frozen=True, slots=True)
class SolveStats:
    """What a solver reports, whichever solver it is (Checkmate's ScheduledResult spirit)."""

    solver: str
    status: SolveStatus
    """"optimal", "time_limit" (best found, see gap), "feasible", "rule" (no search)."""
    objective: float = 0.0
    solve_time_s: float = 0.0
    num_variables: int = 0
    num_constraints: int = 0
    mip_gap: float = 0.0
    message: str = ""


@dataclass(frozen=True, slots=True)
class RecomputePolicy:
    """The policy of one pipeline stage: one LayerPolicy per layer on it, bottom layer first."""

    method: str
    layers: tuple[LayerPolicy, ...]
    cooldown_overlap: bool = False
    """Hide the phase-1/2 recomputation of cool-down micro-batches (no later forward) in pipeline stalls."""
    stats: SolveStats = field(default_factory=lambda: SolveStats(solver="rule", status="rule"))

    def to_dict(self, graph: LayerGraph | None = None) -> dict[str, Any]:
        # Runs of identical layers are stored once with a count, so a 96-layer plan stays readable.
        groups: list[dict[str, Any]] = []
        for lp in self.layers:
            d = lp.to_dict(graph)
            if groups and groups[-1]["ops"] == d:
                groups[-1]["count"] += 1
            else:
                groups.append({"count": 1, "ops": d})
        return {
            "method": self.method,
            "cooldown_overlap": self.cooldown_overlap,
            "layers": groups,
            "stats": {k: getattr(self.stats, k) for k in SolveStats.__slots__},
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> RecomputePolicy:
        try:
            layers: list[LayerPolicy] = []
            for i, g in enumerate(d["layers"]):
                ops = check_field(g["ops"], dict[str, str], f"policy: layers[{i}].ops")
                lp = LayerPolicy.from_dict(ops)
                layers.extend([lp] * check_field(g["count"], int, f"policy: layers[{i}].count",
                                                 Range(gt=0, le=MAX_LAYERS)))
            return RecomputePolicy(
                method=str(d["method"]),
                layers=tuple(layers),
                cooldown_overlap=bool(d.get("cooldown_overlap", False)),
                stats=_stats_from_dict(d.get("stats", {"solver": "rule", "status": "rule"})),
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise PlanFormatError(f"policy: missing or malformed field ({e})") from None


def _stats_from_dict(d: Mapping[str, Any]) -> SolveStats:
    if d.get("status") not in get_args(SolveStatus):
        raise PlanFormatError(f"policy: stats.status {d.get('status')!r}, expected one of "
                              + ", ".join(get_args(SolveStatus)))
    return SolveStats(**d)


@dataclass(frozen=True, slots=True)
class FsdpCharge:
    """Fully sharded data parallelism's collectives on one stage, per micro-batch, in seconds
    (`lynx.cost.fsdp_time.fsdp_charge`; `lynx.cost.stage.charge_stage` charges what compute does not hide)."""

    gather_fwd_s: float = 0.0
    """One layer's parameter all-gather before its forward (0: parameters held gathered)."""
    gather_bwd_s: float = 0.0
    """One layer's all-gather again before its backward (0: not resharded after forward)."""
    reduce_s: float = 0.0
    """One layer's gradient reduce-scatter (and HSDP all-reduce) after its backward (0: reduced once per
    iteration, after the pipeline)."""
    start_s: float = 0.0
    """The gather that opens a forward, which nothing hides (the first unit's)."""
    end_s: float = 0.0
    """The reduction the end of a backward waits for (the last unit's)."""


@dataclass(frozen=True, slots=True)
class StageContext:
    """Everything a per-stage policy algorithm needs to know about its stage (a pipeline rank, with all
    its model chunks when interleaved), besides the graph. The schedule facts in it come from
    `lynx.schedule.derive_facts`; a stand-alone context (``lynx solve``, tests) states them directly."""

    stage: int
    num_stages: int
    num_layers: int
    in_flight: int
    """Micro-batches whose activations the stage holds at its peak (the schedule's facts; with chunks,
    the largest chunk's)."""
    num_microbatches: int
    budget_bytes: float
    """Usable device memory (capacity minus the documented reserve)."""
    static_bytes: float
    """Parameters, gradients and optimizer states of the stage."""
    extra_retained_bytes: float = 0.0
    """Per micro-batch, outside the layers (the first stage's embedding dropout mask)."""
    extra_transient_bytes: float = 0.0
    """Working memory outside the layers (the last stage's logits and loss)."""
    grad_workspace_bytes: float = 0.0
    """Gradient buffers alive during a layer's backward."""
    subtract_wgrad: bool = True
    """Backward windows offer only comm - wgrad (Megatron overlaps wgrad with the dgrad all-reduce)."""
    fwd_windows: bool | None = None
    """Some forward runs between F(j) and B(j) on every chunk of the stage (schedule facts); None: a
    stand-alone stage, read from the facts of stage `stage` of a 1F1B schedule."""
    cooldown_microbatches: int | None = None
    """Backwards with forward windows but no forward of their own to host phase-1/2 work (schedule facts);
    None: a stand-alone stage, read from the facts of stage `stage` of a 1F1B schedule."""
    chunk_layers: tuple[int, ...] = ()
    """Interleaved: layers of each model chunk on the stage, chunk 0 first (empty: one chunk)."""
    chunk_in_flight: tuple[int, ...] = ()
    """Interleaved: micro-batches in flight at each chunk's peak (empty: one chunk, `in_flight`)."""
    live_vectors: tuple[tuple[int, ...], ...] = ()
    """Interleaved: the schedule's Pareto-maximal in-flight counts per chunk (the rank's peak of any
    per-chunk weighting is at one of them); empty: each chunk's own peak, summed (an upper bound)."""
    fsdp: FsdpCharge | None = None
    """FSDP's per-layer collectives (None: no FSDP, or its communication is not charged)."""
    kinds: tuple[str, ...] = ()
    """The kind of each of the stage's layers, bottom first, where the model's layers are of several kinds
    (`lynx.stack`: "dense", "moe"); empty: every layer of the one kind the problem's graph prices."""
    step_bytes: float = 0.0
    """Alive only in the optimizer step, beside `static_bytes` and no activation (the fp16 recipe's fp32
    main-gradient copy, `cost.static_memory.Recipe.step_only_bytes`): the stage's peak is at least static + this.
    A step that does not fit is charged as static instead (`PlanProblem.stage_context`), so that nothing fits."""

    @property
    def num_chunks(self) -> int:
        return max(1, len(self.chunk_layers))

    def _facts(self) -> ChunkFacts:
        return facts_1f1b(self.num_stages, self.num_microbatches).of(self.stage)

    @property
    def has_fwd_windows(self) -> bool:
        """Phases 1, 2 need a forward between F(j) and B(j): not on the last stage, nor with PP = 1."""
        if self.fwd_windows is not None:
            return self.fwd_windows
        return self.in_flight > 1 and self._facts().has_fwd_windows

    @property
    def cooldown_count(self) -> int:
        if not self.has_fwd_windows:
            return 0
        if self.cooldown_microbatches is not None:
            return self.cooldown_microbatches
        return self._facts().cooldown_count

    @property
    def extra_in_flight(self) -> int:
        """Micro-batches holding the non-layer retained bytes (those of the first virtual stage)."""
        return self.chunk_in_flight[0] if self.chunk_in_flight else self.in_flight

    def layer_microbatches(self) -> int:
        """Sum over the stage's layers of the micro-batches in flight of the layer's chunk."""
        if not self.chunk_layers:
            return self.in_flight * self.num_layers
        return round(self.peak_weighted(tuple(float(n) for n in self.chunk_layers)))

    def peak_weighted(self, per_chunk: tuple[float, ...]) -> float:
        """The largest sum over chunks of (micro-batches in flight x `per_chunk` bytes) the schedule reaches."""
        vectors = self.live_vectors or (self.chunk_in_flight,)
        if len(vectors[0]) != len(per_chunk):
            raise ValueError(f"stage {self.stage}: {len(per_chunk)} chunk figures for {len(vectors[0])} chunks")
        return float(max(sum(map(mul, vec, per_chunk)) for vec in vectors))  # the same products, in order

    def chunk_slices(self) -> tuple[tuple[int, int], ...]:
        """(first layer, end) of each chunk in the stage's layer list."""
        counts = self.chunk_layers or (self.num_layers,)
        out, start = [], 0
        for n in counts:
            out.append((start, start + n))
            start += n
        return tuple(out)

    @property
    def activation_budget_bytes(self) -> float:
        """What is left for activations after static memory and the non-layer terms."""
        return (
            self.budget_bytes - self.static_bytes - self.extra_transient_bytes - self.grad_workspace_bytes
            - self.extra_in_flight * self.extra_retained_bytes
        )


def validate_layer_policy(graph: LayerGraph, lp: LayerPolicy, has_fwd_windows: bool = True) -> list[str]:
    """Every rule a layer policy must satisfy; returns the violations (empty when valid).

    - Every op whose state some backward reads is kept or recomputed, never both.
    - A recomputed op's inputs are kept, or recomputed in the same or an earlier phase (same phase:
      earlier in forward order). The layer input is always available.
    - Comm ops are never recomputed inside a window (paper eq. 6): only on demand.
    - Phases 1, 2 only where the stage has forward windows.
    - A re-run op is kept, and its inputs are kept or recomputed (it runs again before its backward).
    - An offloaded op is kept and not re-run; no phase-1/2 recomputation reads it (those run in a later
      forward, before the reload).
    """
    errors: list[str] = []
    names = set(graph.names)
    for n in lp.keep:
        if n not in names:
            errors.append(f"keeps unknown op {n!r}")
    phases: dict[str, Phase] = {}
    for n, p in lp.recompute:
        if n not in names:
            errors.append(f"recomputes unknown op {n!r}")
            continue
        if n in phases:
            errors.append(f"recomputes {n!r} twice")
        if n in lp.keep:
            errors.append(f"{n!r} is both kept and recomputed")
        phases[n] = p
    for n in graph.needed():
        if n not in lp.keep and n not in phases:
            errors.append(f"{n!r} is needed by backward but neither kept nor recomputed")
    for n in sorted(lp.rerun):
        if n not in lp.keep:
            errors.append(f"{n!r} is re-run but not kept (keep+rerun keeps the output)")
            continue
        for dep in graph.op(n).inputs:
            if dep != LAYER_INPUT and dep not in lp.keep and dep not in phases:
                errors.append(f"{n!r} is re-run but its input {dep!r} is neither kept nor recomputed")
    for n in sorted(lp.offload):
        if n not in lp.keep:
            errors.append(f"{n!r} is offloaded but not kept (offload keeps the output on the host)")
        if n in lp.rerun:
            errors.append(f"{n!r} is both offloaded and re-run")
    order = {n: i for i, n in enumerate(graph.names)}
    for n, p in phases.items():
        if p in FWD_PHASES and any(d in lp.offload for d in graph.op(n).inputs):
            errors.append(f"{n!r} (phase {int(p)}) reads an offloaded input, which is back only before the "
                          "backward")
        op = graph.op(n)
        if op.is_comm and p != Phase.ON_DEMAND:
            errors.append(f"comm op {n!r} can only be recomputed on demand, not in phase {int(p)}")
        if p in FWD_PHASES and not has_fwd_windows:
            errors.append(f"{n!r} uses phase {int(p)} but this stage has no forward windows")
        for dep in op.inputs:
            if dep == LAYER_INPUT or dep in lp.keep:
                continue
            dp = phases.get(dep)
            if dp is None:
                errors.append(f"{n!r} is recomputed but its input {dep!r} is neither kept nor recomputed")
            elif dp > p or (dp == p and order[dep] > order[n]):
                errors.append(f"{n!r} (phase {int(p)}) needs {dep!r}, recomputed later (phase {int(dp)})")
    return errors


def check_policy(graph: Graphs, policy: RecomputePolicy, ctx: StageContext) -> None:
    """Raise PlanFormatError if any layer of the stage policy is invalid (each against its own layer's graph)."""
    if len(policy.layers) != ctx.num_layers:
        raise PlanFormatError(
            f"stage {ctx.stage}: policy has {len(policy.layers)} layers, stage has {ctx.num_layers}"
        )
    gs = per_layer(graph, len(policy.layers))
    seen: dict[tuple[int, int], list[str]] = {}  # a stage repeats a few (graph, layer policy) objects
    for i, lp in enumerate(policy.layers):
        key = (id(gs[i]), id(lp))
        if key not in seen:
            seen[key] = validate_layer_policy(gs[i], lp, ctx.has_fwd_windows)
        errs = list(seen[key])
        if not lp.input_checkpoint:
            below = policy.layers[i - 1] if i > 0 else None
            if below is None or below.keep or any(p != Phase.ON_DEMAND for _, p in below.recompute):
                errs.append("drops its input checkpoint, but the layer below is not fully recomputed on demand")
            if lp.keep or any(p != Phase.ON_DEMAND for _, p in lp.recompute):
                errs.append("drops its input checkpoint, so it must recompute everything on demand")
        if errs:
            raise PlanFormatError(f"stage {ctx.stage} layer {i} ({policy.method}): " + "; ".join(errs))
