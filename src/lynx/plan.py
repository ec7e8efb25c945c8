"""The plan file: model, hardware, layout, layer graph, partition, per-stage policy and prediction.

JSON with a schema version (docs/plan-format.md). `lynx simulate plan.json` re-evaluates it; the runtime
reads the per-op policy by op name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lynx.checks import check_graph_matches, check_inputs, check_result
from lynx.decisions import RecomputePolicy
from lynx.errors import LynxError, PlanFormatError, SpecError
from lynx.families.gpt import MODULE_OF
from lynx.graph import LayerGraph
from lynx.models import model_from_dict
from lynx.partition.base import Partition
from lynx.paths import MAX_JSON_BYTES, read_text, write_text
from lynx.problem import PlanOptions, PlanProblem, PlanResult
from lynx.schedule import Schedule
from lynx.simulate import SimResult, simulate
from lynx.spec import (
    ModelSpec,
    ParallelSpec,
    hardware_from_dict,
    hardware_to_dict,
    model_to_dict,
    parallel_from_dict,
    parallel_to_dict,
)
from lynx.stack import LayerKind, kinds_present
from lynx.validate import NON_NEGATIVE, build, check_field

PLAN_SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Version 2 added ``options.vpp``, ``partition.chunks`` and ``schedule`` (interleaved 1F1B); a version-1
file reads as vpp 1."""


@dataclass(frozen=True, slots=True)
class StagePrediction:
    stage: int
    num_layers: int
    peak_memory_bytes: float
    budget_bytes: float
    static_bytes: float
    oom: bool
    recompute_critical_s: float
    recompute_overlapped_s: float
    fwd_time_s: float
    bwd_time_s: float
    copy_exposed_s: float = 0.0
    """Offload copies waited for over the iteration (docs/offload.md); with the next two, written only when the
    plan offloads."""
    offloaded_bytes: float = 0.0
    host_bytes: float = 0.0


_OFFLOAD_FIELDS = ("copy_exposed_s", "offloaded_bytes", "host_bytes")


@dataclass(frozen=True, slots=True)
class Prediction:
    """What the simulator predicts for a plan (stored in the plan file, recomputed on reading)."""

    iteration_time_s: float
    samples_per_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    mfu: float
    bubble_fraction: float
    oom: bool
    stages: tuple[StagePrediction, ...]

    @staticmethod
    def of(s: SimResult) -> Prediction:
        return Prediction(
            iteration_time_s=s.iteration_time_s, samples_per_s=s.samples_per_s, tokens_per_s=s.tokens_per_s,
            model_tflops_per_gpu=s.model_tflops_per_gpu, mfu=s.mfu, bubble_fraction=s.bubble_fraction, oom=s.oom,
            stages=tuple(StagePrediction(
                stage=st.stage, num_layers=st.num_layers, peak_memory_bytes=st.peak_memory_bytes,
                budget_bytes=st.budget_bytes, static_bytes=st.static_bytes, oom=st.oom,
                recompute_critical_s=st.recompute_critical_s, recompute_overlapped_s=st.recompute_overlapped_s,
                fwd_time_s=st.fwd_time_s, bwd_time_s=st.bwd_time_s, copy_exposed_s=st.copy_exposed_s,
                offloaded_bytes=st.offloaded_bytes, host_bytes=st.host_bytes) for st in s.stages),
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = [asdict(st) for st in self.stages]
        if not any(st.offloaded_bytes for st in self.stages):  # written as before offloading existed
            for st in d["stages"]:
                for k in _OFFLOAD_FIELDS:
                    st.pop(k, None)
        return d


@dataclass(frozen=True, slots=True)
class Plan:
    problem: PlanProblem
    result: PlanResult
    sim: SimResult

    @staticmethod
    def evaluate(problem: PlanProblem, result: PlanResult, record: bool = True,
                 schedule: Schedule | None = None) -> Plan:
        """Simulate a planning result (under the problem's schedule unless `schedule` is given);
        `record=False` skips the Gantt segments and memory curves."""
        sim = simulate(problem, result.partition, result.policies, record=record, schedule=schedule)
        return Plan(problem, result, sim)

    @property
    def prediction(self) -> Prediction:
        return Prediction.of(self.sim)

    def to_dict(self) -> dict[str, Any]:
        p, r = self.problem, self.result
        opts = asdict(p.options)
        if opts.get("layers_per_stage") is not None:
            opts["layers_per_stage"] = list(opts["layers_per_stage"])
        return {
            "schema_version": PLAN_SCHEMA_VERSION,
            "method": r.method,
            "model": model_to_dict(p.model),
            "hardware": hardware_to_dict(p.hardware),
            "parallel": parallel_to_dict(p.parallel),
            "options": opts,
            "partition": {"method": r.partition.method, "layers_per_stage": list(r.partition.layers_per_stage),
                          "chunks": list(r.partition.chunks)},
            "schedule": {"name": p.schedule.name, "vpp": p.options.vpp},
            # several layer kinds: each layer lists its own ops (no one graph's order)
            "stages": [pol.to_dict(None if p.heterogeneous else p.graph) for pol in r.policies],
            "notes": list(r.notes),
            "search_time_s": r.search_time_s,
            "prediction": self.prediction.to_dict(),
            "graph": p.graph.to_dict(),
            **({"kind_graphs": {k: g.to_dict() for k, g in p.kind_graphs}} if p.heterogeneous else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> None:
        write_text(path, self.to_json(), "plan")


def plan_from_dict(d: Mapping[str, Any], where: str = "plan") -> tuple[PlanProblem, PlanResult]:
    """Read a plan back and validate it exactly as `lynx plan` validates its inputs (the prediction is
    recomputed by whoever needs it, never trusted)."""
    if d.get("schema_version") not in READABLE_VERSIONS:
        raise PlanFormatError(
            f"{where}: schema_version {d.get('schema_version')!r}, this lynx reads "
            + " and ".join(map(str, READABLE_VERSIONS))
        )
    try:
        # The spec loaders (which may add defaults, e.g. a model family's) with this file's name in messages.
        model = model_from_dict(d["model"], f"{where}: model")
        hardware = hardware_from_dict(d["hardware"], f"{where}: hardware")
        parallel = parallel_from_dict(d["parallel"], f"{where}: parallel")
        options = build(PlanOptions, d.get("options", {}), f"{where}: options", PlanFormatError)
        check_inputs(model, hardware, parallel, options)
        graph = LayerGraph.from_dict(d["graph"], MODULE_OF)
        check_graph_matches(graph, model, parallel)
        problem = PlanProblem(model=model, hardware=hardware, parallel=parallel, graph=graph, options=options,
                              kind_graphs=_kind_graphs(d, model, parallel, where))
        part_d = d["partition"]
        lps = check_field(part_d.get("layers_per_stage"), tuple[int, ...], f"{where}: partition.layers_per_stage")
        chunks = check_field(part_d.get("chunks", ()), tuple[int, ...], f"{where}: partition.chunks", NON_NEGATIVE)
        try:  # the first and the last chunk may be 0 (the embedding or the loss alone): `Partition` says which
            part = Partition(lps, str(part_d.get("method", "explicit")), chunks)
        except SpecError as e:
            raise PlanFormatError(f"{where}: {e}") from None
        if part.num_chunks != problem.options.vpp:
            raise PlanFormatError(f"{where}: partition has {part.num_chunks} chunks per stage, options.vpp "
                                  f"{problem.options.vpp}")
        pols = tuple(RecomputePolicy.from_dict(s) for s in d["stages"])
        search_s = check_field(d.get("search_time_s", 0.0), float, f"{where}: search_time_s", NON_NEGATIVE)
        result = PlanResult(str(d["method"]), part, pols, tuple(map(str, d.get("notes", ()))), search_s)
        check_result(problem, result, where)
    except (KeyError, TypeError, AttributeError) as e:
        raise PlanFormatError(f"{where}: missing or malformed field ({e})") from None
    except LynxError as e:  # layout, graph and policy checks: name the file
        raise PlanFormatError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
    return problem, result


def load_plan(path: str | Path) -> tuple[PlanProblem, PlanResult]:
    text = read_text(path, "plan", MAX_JSON_BYTES, PlanFormatError)
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanFormatError(f"{path}: not a JSON plan ({e})") from None
    except RecursionError:
        raise PlanFormatError(f"{path}: nested too deeply; not a JSON plan") from None
    if not isinstance(d, dict):
        raise PlanFormatError(f"{path}: not a JSON plan object")
    return plan_from_dict(d, f"{path}")


def policies_per_virtual_stage(pols: tuple[RecomputePolicy, ...], counts: tuple[int, ...], pp: int,
                               vpp: int) -> tuple[RecomputePolicy, ...]:
    """An interleaved plan's policies, one per virtual stage (v = chunk * pp + rank): a plan with one policy
    per rank (the rank's layers, chunk 0 first) is split by the layer counts of its chunks; one per virtual
    stage is returned as it is. Shared by the export and the runtime."""
    if vpp == 1 or len(pols) != pp or len(counts) != pp * vpp:
        return pols
    out: list[RecomputePolicy | None] = [None] * len(counts)
    for r, pol in enumerate(pols):
        lo = 0
        for c in range(vpp):
            n = counts[c * pp + r]
            out[c * pp + r] = dataclasses.replace(pol, layers=pol.layers[lo:lo + n])
            lo += n
        if lo != len(pol.layers):
            raise PlanFormatError(f"plan: stage {r} policy covers {len(pol.layers)} layers, its chunks {lo}")
    return tuple(p for p in out if p is not None)


def _kind_graphs(d: Mapping[str, Any], model: ModelSpec, parallel: ParallelSpec, where: str
                 ) -> tuple[tuple[LayerKind, LayerGraph], ...]:
    """A plan of a model of several layer kinds carries one graph per kind (docs/decisions/0221)."""
    kinds = kinds_present(model)
    if len(kinds) == 1:
        return ()
    kg = d.get("kind_graphs")
    if not isinstance(kg, Mapping) or sorted(kg) != sorted(kinds):
        raise PlanFormatError(f"{where}: kind_graphs must hold one graph for each of the model's layer kinds "
                              f"({', '.join(kinds)})")
    out = []
    for k in kinds:
        g = LayerGraph.from_dict(kg[k])
        check_graph_matches(g, model, parallel)
        out.append((k, g))
    return tuple(out)

