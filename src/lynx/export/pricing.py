"""Price a plan and the Megatron configurations that approximate it, with lynx's own simulator.

This module is export/'s only door into the planner (lynx.api, lynx.plan): `_run` is the one function that
calls it, and it reads results through `Plan.prediction()`, the plan file's documented prediction block, so
a refactor of the simulator's internals does not reach here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from lynx.errors import SpecError
from lynx.export.layout import ChunkLayout, even_layout
from lynx.export.megatron_recompute import MegatronRecompute, stack_policies
from lynx.problem import PlanOptions, PlanProblem, PlanResult
from lynx.spec import ModelSpec, ParallelSpec

Offload = Sequence[Mapping[str, Any]] | None
"""The plugin's offload entry per virtual stage (`export.megatron_offload.offload_entry`; empty: none)."""

if TYPE_CHECKING:
    from lynx.decisions import LayerPolicy
    from lynx.partition.base import Partition
    from lynx.plan import Plan


@dataclass(frozen=True, slots=True)
class StageFigures:
    stage: int
    num_layers: int
    peak_bytes: float
    budget_bytes: float

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes


@dataclass(frozen=True, slots=True)
class Figures:
    """What the simulator predicts for one configuration."""

    label: str
    setting: str
    iteration_time_s: float
    samples_per_s: float
    stages: tuple[StageFigures, ...]
    plan: Plan | None = field(default=None, compare=False, repr=False)
    """The simulated plan (to save with --out)."""

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "setting": self.setting, "iteration_time_s": self.iteration_time_s,
                "samples_per_s": self.samples_per_s, "fits": self.fits,
                "stages": [{"stage": s.stage, "num_layers": s.num_layers, "peak_memory_bytes": s.peak_bytes,
                            "budget_bytes": s.budget_bytes, "fits": s.fits} for s in self.stages]}


def _prediction(plan: Plan) -> dict[str, Any]:
    """The plan file's prediction block (`Prediction.to_dict`)."""
    raw: Any = plan.prediction
    return dict(raw() if callable(raw) else raw.to_dict())


def _figures(label: str, setting: str, plan: Plan) -> Figures:
    pred = _prediction(plan)
    stages = tuple(StageFigures(int(s["stage"]), int(s["num_layers"]), float(s["peak_memory_bytes"]),
                                float(s["budget_bytes"])) for s in pred["stages"])
    return Figures(label, setting, float(pred["iteration_time_s"]), float(pred["samples_per_s"]), stages, plan)


# A Megatron setting the method registry already knows: (method, --recompute-num-layers).
def _registry_method(rec: MegatronRecompute) -> tuple[str, int | None] | None:
    if rec.granularity is None:
        return "none", None
    if rec.granularity == "selective":
        if rec.modules == ("core_attn",):
            return "selective", None
        from lynx.methods import available_methods

        # the Megatron module-list baselines are registered as "mc-<modules>" (core_attn, mlp, layernorm order)
        name = "mc-" + "+".join(m for m in ("core_attn", "mlp", "layernorm") if m in rec.modules)
        return (name, None) if name in available_methods() else None
    return str(rec.method), rec.num_layers


def _run(problem: PlanProblem, layout: ChunkLayout | None,
         how: str | PlanResult | MegatronRecompute | Sequence[MegatronRecompute],
         offload: Offload = None) -> Plan:
    """The one call into the planner: plan with a registered method, simulate a lynx result, one global
    Megatron setting (through the method registry when it has that baseline), or one setting per virtual
    stage (policies built here; with interleaving, one policy per rank, chunk 0's layers first). `offload`:
    the plugin's offload entry per virtual stage (`export.megatron_offload`), applied on top."""
    from lynx.api import plan as plan_with
    from lynx.plan import Plan

    if isinstance(how, str):
        return plan_with(problem, how, record=False)
    if isinstance(how, PlanResult):
        return Plan.evaluate(problem, how, record=False)
    assert layout is not None
    if isinstance(how, MegatronRecompute):
        known = _registry_method(how) if layout.vpp == 1 and not offload else None
        if known is not None:
            method, n = known
            opts = replace(problem.options, layers_per_stage=layout.layers, recompute_num_layers=n)
            return plan_with(replace(problem, options=opts), method, record=False)
        how = [how] * len(layout.layers)
    from lynx.decisions import RecomputePolicy

    problem, part = _per_stage_problem(problem, layout)
    pols = tuple(RecomputePolicy("megatron", _rank_layers(problem, layout, how, offload, r))
                 for r in range(layout.pp))
    return Plan.evaluate(problem, PlanResult("megatron", part, pols), record=False)


def _per_stage_problem(problem: PlanProblem, layout: ChunkLayout) -> tuple[PlanProblem, Partition]:
    """The problem (its VPP) and the explicit partition per-stage Megatron settings are priced on."""
    from lynx.partition.base import Partition

    if layout.vpp == 1:
        return problem, Partition(layout.layers, "explicit")
    return (replace(problem, options=replace(problem.options, vpp=layout.vpp)),
            Partition.interleaved(layout.layers, layout.pp, "explicit"))


def _rank_layers(problem: PlanProblem, layout: ChunkLayout, settings: Sequence[MegatronRecompute],
                 offload: Offload, rank: int) -> tuple[LayerPolicy, ...]:
    """Rank `rank`'s layer policies under one Megatron setting per virtual stage (chunk 0's layers first), with
    the plugin's offload entries where given."""
    out: list[LayerPolicy] = []
    for v in range(rank, len(layout.layers), layout.pp):
        n = layout.layers[v]
        lps = stack_policies(problem.range_graphs(layout.first_layer(v), n), settings[v], n)
        if offload:
            from lynx.export.megatron_offload import apply_offload

            lps = apply_offload(problem.graph, tuple(lps), offload[v])
        out += lps
    return tuple(out)


class _RankFloor:
    """Whether a rank's replay-free memory floor (`memory.stage_floor_bytes`: static, non-layer and what its
    in-flight micro-batches hold) fits its budget under some per-stage settings. The floor never exceeds the peak
    the simulator replays for the rank (its first terms; tests/unit/test_export_floor.py), so a setting over it
    cannot fit and is not simulated: `fastest_fitting` tries the cheapest settings first, most of which do not
    fit. The stage contexts depend on the layout alone and are built once."""

    def __init__(self, problem: PlanProblem, layout: ChunkLayout, offload: Offload) -> None:
        self.problem, part = _per_stage_problem(problem, layout)
        self.layout, self.offload = layout, offload
        self.ctxs = self.problem.stage_contexts(part)

    def bytes(self, settings: Sequence[MegatronRecompute], rank: int) -> float:
        from lynx.cost.memory import layer_memories, stage_floor_bytes

        ctx = self.ctxs[rank]
        layers = _rank_layers(self.problem, self.layout, settings, self.offload, rank)
        return stage_floor_bytes(layer_memories(self.problem.graphs_for(ctx), layers), ctx)

    def fits(self, settings: Sequence[MegatronRecompute], rank: int) -> bool:
        return self.bytes(settings, rank) <= self.ctxs[rank].budget_bytes


def _check_simulable(problem: PlanProblem, layout: ChunkLayout) -> None:
    """The layout is a partition of the problem's PP (`Partition`: an empty first or last virtual stage holds the
    embedding or the loss alone, as Megatron builds it)."""
    from lynx.partition.base import Partition

    if layout.pp != problem.parallel.pp:
        raise SpecError(f"layout {layout.layers} does not fit PP {problem.parallel.pp}")
    try:
        Partition.interleaved(layout.layers, layout.pp)
    except SpecError:
        raise SpecError(f"layout {layout.layers} does not fit PP {problem.parallel.pp}") from None


def simulate_lynx(problem: PlanProblem, result: PlanResult) -> Figures:
    """The lynx plan as lynx's runtime runs it (recomputation overlapped with collectives and stalls)."""
    return _figures("lynx", f"{result.method} (per-stage, overlapped)", _run(problem, None, result))


def plan_method(problem: PlanProblem, method: str) -> Figures:
    """Plan the problem afresh with a registered method (lynx's answer to an imported config)."""
    plan = _run(problem, None, method)
    return _figures(method, f"{plan.result.method}, partition {plan.result.partition}", plan)


def simulate_stock(problem: PlanProblem, layout: ChunkLayout, rec: MegatronRecompute,
                   offload: Offload = None) -> Figures:
    """Stock Megatron-Core: the layout and one global recomputation setting (and the global offload flags)."""
    _check_simulable(problem, layout)
    return _figures("megatron", rec.describe(), _run(problem, layout, rec, offload))


def simulate_per_stage(problem: PlanProblem, layout: ChunkLayout, settings: Sequence[MegatronRecompute],
                       offload: Offload = None) -> Figures:
    """Megatron-Core with the lynx plugin: each stage its own setting, every recomputation on demand (and each
    stage's offloading, when the plan offloads)."""
    _check_simulable(problem, layout)
    label = "per stage: " + " | ".join(s.short() for s in settings)
    return _figures("megatron+plugin", label, _run(problem, layout, settings, offload))


def imported_problem(model: ModelSpec, parallel: ParallelSpec, layout: ChunkLayout, hardware: str,
                     options: PlanOptions) -> PlanProblem:
    """A lynx problem for a configuration read from another framework, with its partition fixed."""
    from lynx.api import make_problem
    from lynx.spec import load_hardware

    if layout.vpp == 1:
        opts = replace(options, layers_per_stage=layout.layers)
    else:  # a virtual stage holding the embedding or the loss alone is what Megatron's account-for flags build
        opts = replace(options, vpp=layout.vpp,
                       account_for_embedding_in_pipeline_split=options.account_for_embedding_in_pipeline_split
                       or layout.layers[0] == 0,
                       account_for_loss_in_pipeline_split=options.account_for_loss_in_pipeline_split
                       or layout.layers[-1] == 0)
    return make_problem(model, load_hardware(hardware), parallel, opts)


def fastest_fitting(problem: PlanProblem, layout: ChunkLayout, start: Sequence[MegatronRecompute],
                    offload: Offload = None) -> tuple[list[MegatronRecompute], list[bool]]:
    """Per (virtual) stage, the cheapest Megatron setting (forward work rerun) with which the simulator says
    its rank fits; memory is per rank, so ranks are independent. Each rank first gets the cheapest setting
    shared by all its chunks that fits (without interleaving that is exact); with interleaving each chunk
    then tries cheaper settings of its own while the rank still fits. A rank where nothing fits keeps
    `start`. Returns the settings and, per stage, whether they fit.

    The ranks try their settings side by side: each round simulates one pipeline in which every rank still
    looking tries its next setting (cheapest first, over its memory floor skipped), and each rank reads its own
    fit from it, so a deep pipeline costs as many simulations as its most frugal rank needs tries, not their sum."""
    from lynx.export.megatron_recompute import candidates, recompute_cost

    _check_simulable(problem, layout)
    g, pp = problem.graph, layout.pp
    chosen, found = list(start), [False] * len(start)
    floor = _RankFloor(problem, layout, offload)

    stages = [[c * pp + r for c in range(layout.vpp)] for r in range(pp)]

    def on_rank(base: list[MegatronRecompute], r: int, cand: MegatronRecompute) -> list[MegatronRecompute]:
        return [cand if i in stages[r] else x for i, x in enumerate(base)]

    def cheapest_first(r: int) -> list[MegatronRecompute]:
        vs = stages[r]
        pool = {c for v in vs for c in candidates(g, layout.layers[v])}
        return sorted(pool, key=lambda c: (sum(recompute_cost(g, c, layout.layers[v]) for v in vs), c.short()))

    tries = {r: iter(cheapest_first(r)) for r in range(pp)}
    looking = list(range(pp))
    while looking:
        testing: dict[int, MegatronRecompute] = {}
        for r in looking:  # each rank's next setting over its memory floor
            cand = next((c for c in tries[r] if floor.fits(on_rank(chosen, r, c), r)), None)
            if cand is not None:
                testing[r] = cand
        if not testing:
            break
        trial = list(chosen)
        for r, cand in testing.items():
            trial = on_rank(trial, r, cand)
        sim = simulate_per_stage(problem, layout, trial, offload)
        for r, cand in testing.items():
            if sim.stages[r].fits:
                chosen = on_rank(chosen, r, cand)
                for v in stages[r]:
                    found[v] = True
        looking = [r for r in testing if not found[stages[r][0]]]
    if layout.vpp > 1:  # each chunk of a rank that fits tries cheaper settings of its own, ranks side by side
        _chunks_side_by_side(problem, layout, chosen, [r for r in range(pp) if found[stages[r][0]]], floor, offload)
    return chosen, found


def _chunks_side_by_side(problem: PlanProblem, layout: ChunkLayout, chosen: list[MegatronRecompute],
                         ranks: list[int], floor: _RankFloor, offload: Offload) -> None:
    """`fastest_fitting`'s second step, in place: on each of `ranks`, chunk by chunk, the cheapest setting
    cheaper than the chunk's own with which the rank still fits. Every rank proposes its next trial; one simulation
    per round answers them all (a rank reads its own fit)."""
    from lynx.export.megatron_recompute import candidates, recompute_cost

    g, pp = problem.graph, layout.pp

    def refine(r: int) -> Generator[tuple[int, MegatronRecompute], bool, None]:
        for v in range(r, len(layout.layers), pp):
            n = layout.layers[v]
            for cand in candidates(g, n):
                if recompute_cost(g, cand, n) >= recompute_cost(g, chosen[v], n):
                    break
                if not floor.fits([*chosen[:v], cand, *chosen[v + 1:]], r):
                    continue
                if (yield v, cand):
                    chosen[v] = cand
                    break

    gens = {r: refine(r) for r in ranks}
    pending = {r: p for r, gen in gens.items() if (p := next(gen, None)) is not None}
    while pending:
        trial = list(chosen)
        for v, cand in pending.values():
            trial[v] = cand
        sim = simulate_per_stage(problem, layout, trial, offload)
        answered = {}
        for r in pending:
            with contextlib.suppress(StopIteration):  # the rank has tried every chunk
                answered[r] = gens[r].send(sim.stages[r].fits)
        pending = answered


def fastest_fitting_global(problem: PlanProblem, layout: ChunkLayout,
                           offload: Offload = None) -> MegatronRecompute | None:
    """The cheapest single setting with which every stage fits (what a stock-Megatron user would tune to)."""
    from lynx.export.megatron_recompute import candidates, recompute_cost

    _check_simulable(problem, layout)
    g = problem.graph
    pool = {c for n in set(layout.layers) for c in candidates(g, n)}
    floor = _RankFloor(problem, layout, offload)
    for cand in sorted(pool, key=lambda r: (sum(recompute_cost(g, r, n) for n in layout.layers), r.short())):
        trial = [cand] * len(layout.layers)
        if all(floor.fits(trial, r) for r in range(layout.pp)) and \
                simulate_per_stage(problem, layout, trial, offload).fits:
            return cand
    return None


def stock_on_even_split(problem: PlanProblem, layout: ChunkLayout) -> tuple[Figures | None, str]:
    """Stock Megatron on its own default partition (num_layers / (PP x VPP) per virtual stage, no layout flag)
    with the cheapest single setting that fits every stage: what a user who runs neither lynx's layout nor
    its plugin gets. (None, why) when Megatron refuses the split or no setting fits it."""
    try:
        even = even_layout(layout.pp, layout.vpp, layout.num_layers, "--num-layers")
    except SpecError as e:
        return None, f"stock Megatron without the layout flag: Megatron refuses ({e})"
    rec = fastest_fitting_global(problem, even)
    if rec is None:
        return None, f"stock Megatron on its even split {even.layers}: no single recomputation setting fits"
    fig = simulate_stock(problem, even, rec)
    return replace(fig, label="megatron (even split)", setting=f"{fig.setting}; layers {even.layers}"), ""
