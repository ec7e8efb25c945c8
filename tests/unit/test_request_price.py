"""Issue 30 item 1, "one request, one price": every candidate the configuration search reports, planned alone
from the plan file it writes, gives the same iteration time and per-stage peaks, and `lynx memory --plan` the
same simulated peak. Hypothesis draws searches over several spaces (models, GPU counts, sequence lengths,
Megatron's overlaps on and off, CP, VPP, offloading); the default run draws a few, the slow variant many."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lynx.breakdown import stage_memories
from lynx.models import load_model
from lynx.plan import Plan, load_plan
from lynx.problem import PlanOptions
from lynx.request import Request
from lynx.search import Pins, Space, search
from lynx.search.evaluate import Outcome
from lynx.spec import load_hardware


@dataclass(frozen=True)
class Draw:
    model: str
    hardware: str
    gpus: int
    seq: int
    gb: int
    overlaps: bool
    cp: int | None
    vpp: int | None
    offload: bool
    tp: int | None = None


SPACES = st.builds(
    Draw,
    model=st.sampled_from(["gpt-tiny", "llama-tiny", "gpt-1.3b"]),
    hardware=st.sampled_from(["a100-40g-nvlink", "h100-80g-nvlink"]),
    gpus=st.sampled_from([2, 4, 8]),
    seq=st.sampled_from([256, 512, 1024]),
    gb=st.sampled_from([8, 16]),
    overlaps=st.booleans(),
    cp=st.sampled_from([None, 1, 2]),
    vpp=st.sampled_from([None, 1, 2]),
    offload=st.booleans(),
    tp=st.sampled_from([None, 2]),
)


@functools.lru_cache(maxsize=8)
def _search(d: Draw, top: int) -> tuple[Outcome, ...]:
    model, hw = load_model(d.model), load_hardware(d.hardware)
    base = PlanOptions(overlap_grad_reduce=d.overlaps, overlap_param_gather=d.overlaps, tp_comm_overlap=d.overlaps,
                       distributed_optimizer=d.overlaps, nodes=max(1, d.gpus // hw.devices_per_node))
    pins = Pins(tp=d.tp, vpp=d.vpp, cp=d.cp, sp=True if d.overlaps else None, dist_opt=True if d.overlaps else None)
    res = search(Space(model, hw, d.gpus, d.gb, d.seq, pins, offload=d.offload), base, top=top)
    return res.ranked[:top]


def _printed(plan: Plan) -> tuple[str, tuple[str, ...]]:
    """What the tables print: the iteration to the ms, each stage's peak to 0.1 GiB."""
    s = plan.sim
    return f"{s.iteration_time_s:.3f}", tuple(f"{st.peak_memory_bytes / 2**30:.1f}" for st in s.stages)


def _check(d: Draw, tmp: Path, top: int = 3) -> None:
    outs = _search(d, top)
    assert outs, d
    for i, o in enumerate(outs):
        assert o.plan is not None
        path = tmp / f"c{i}.json"
        Plan.evaluate(o.plan.problem, o.plan.result).save(path)  # what `lynx plan --gpus --out` writes
        problem, result = load_plan(path)
        alone = Request.of_problem(problem, o.candidate.method)
        fresh = replace(alone, graph=None).problem()  # the plan file's request, its graph priced anew
        reread = Plan.evaluate(fresh, result, record=False)
        want = (f"{o.iteration_s:.3f}", tuple(f"{p:.1f}" for p in o.stage_peak_gib))
        assert _printed(reread) == want, (d, o.candidate)
        assert reread.sim.iteration_time_s == pytest.approx(o.iteration_s, rel=1e-12)
        # `lynx memory --plan`: the same simulated peak per stage
        mem = stage_memories(Plan.evaluate(problem, result, record=False))
        assert tuple(f"{(m.simulated_peak_bytes or 0.0) / 2**30:.1f}" for m in mem) == want[1]
        if o.candidate.stock or o.candidate.method in ("lynx", "lynx-offload"):
            # `lynx plan` of the same layout and method, from the plan file's request (partition planned anew)
            opts = problem.options if o.candidate.stock else replace(problem.options, layers_per_stage=None)
            again = replace(alone, options=opts, graph=None).plan()
            assert _printed(again) == want, (d, o.candidate, again.result.partition, o.partition)


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(SPACES)
def test_search_prices_what_plan_prices(tmp_path: Path, d: Draw) -> None:
    assume(_search(d, 3))  # a space with no layout that fits (e.g. CP on a model without flash attention)
    _check(d, tmp_path)


@pytest.mark.slow
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(SPACES)
def test_search_prices_what_plan_prices_many(tmp_path: Path, d: Draw) -> None:
    assume(_search(d, 3))
    _check(d, tmp_path)


def test_search_prices_tp_comm_overlap_as_plan_does(tmp_path: Path) -> None:
    """The defect the issue found: the search built its graphs without --tp-comm-overlap (TP 2 pinned, SP, 8k)."""
    d = Draw("llama3-8b", "h100-80g-nvlink", 8, 8192, 16, True, 1, 1, False, 2)
    _check(d, tmp_path, top=2)


def test_search_prices_its_production_overlaps_as_plan_does(tmp_path: Path) -> None:
    """The search turns on --tp-comm-overlap for a sequence-parallel layout (production overlaps, the default) and
    writes it in the plan file: the layout's graph must be priced with it too (TP 2, 2 GPUs, no flag given)."""
    d = Draw("gpt-tiny", "a100-40g-nvlink", 2, 256, 16, False, None, None, False, 2)
    _check(d, tmp_path)
