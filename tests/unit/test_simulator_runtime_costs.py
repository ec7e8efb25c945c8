"""Measured runtime costs on a graph (`RuntimeCosts`, docs/runtime-overhead.md): priced only when present."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lynx.api import make_problem
from lynx.cost.collectives import allreduce_time
from lynx.cost.runtime import measured_hardware, tied_embedding_sync_time
from lynx.errors import PlanFormatError
from lynx.graph import LayerGraph, RuntimeCosts
from lynx.partition.base import Partition
from lynx.policy.rules import full_policy, none_policy
from lynx.problem import PlanOptions, PlanProblem
from lynx.simulate import simulate
from lynx.spec import ModelSpec, ParallelSpec, load_hardware

RC = RuntimeCosts(restore_op_s=2e-4, gemm_flops=5e10, memory_bw_Bps=1e10)


def _problem(pp: int, runtime: RuntimeCosts | None, tie: bool = True) -> PlanProblem:
    model = ModelSpec("m", 4, 512, 8, vocab_size=1024, tie_embeddings=tie)
    par = ParallelSpec(tp=1, pp=pp, micro_batch_size=2, global_batch_size=8, seq_length=256)
    prob = make_problem(model, load_hardware("a100-40g-nvlink"), par, PlanOptions())
    return replace(prob, graph=replace(prob.graph, runtime=runtime)) if runtime is not None else prob


def _sim(prob: PlanProblem, rule):  # type: ignore[no-untyped-def]
    pp = prob.parallel.pp
    part = Partition((4 // pp,) * pp)
    ctxs = prob.stage_contexts(part)
    return simulate(prob, part, tuple(rule(c, prob.graph) for c in ctxs))


def test_graph_json_round_trip_and_analytic_json_unchanged() -> None:
    g = _problem(2, None).graph
    assert "runtime" not in g.to_dict()
    g2 = replace(g, runtime=RC)
    assert LayerGraph.from_json(g2.to_json()) == g2
    bad = g2.to_dict()
    bad["runtime"]["restore_op_s"] = -1.0
    with pytest.raises(PlanFormatError, match="runtime"):
        LayerGraph.from_dict(bad)


def test_zero_costs_change_nothing_but_the_device_rates() -> None:
    base = _sim(_problem(2, None), full_policy)
    same = _sim(_problem(2, RuntimeCosts()), full_policy)  # nothing measured: only the tied sync is added
    sync = tied_embedding_sync_time(_problem(2, None).model, _problem(2, None).parallel,
                                    load_hardware("a100-40g-nvlink"), _problem(2, None).static_recipe.grad_bytes)
    assert sync > 0
    assert same.pipeline_time_s == base.pipeline_time_s
    assert same.iteration_time_s > base.iteration_time_s


def test_restore_overhead_is_charged_per_recomputed_op() -> None:
    prob = _problem(1, None)
    ops_per_layer = len(full_policy(prob.stage_contexts(Partition((4,)))[0], prob.graph).layers[0].recompute)
    rc = RuntimeCosts(restore_op_s=1e-3)
    full0, full1 = _sim(prob, full_policy), _sim(_problem(1, rc), full_policy)
    none0, none1 = _sim(prob, none_policy), _sim(_problem(1, rc), none_policy)
    assert none1.iteration_time_s == none0.iteration_time_s  # nothing restored, nothing charged
    extra = full1.stages[0].recompute_total_s - full0.stages[0].recompute_total_s
    assert extra == pytest.approx(4 * 4 * ops_per_layer * 1e-3)  # 4 layers x 4 micro-batches


def test_measured_device_prices_edges_and_tied_sync_waits_for_both_ends() -> None:
    hw = load_hardware("a100-40g-nvlink")
    m = measured_hardware(hw, RC)
    assert m.device.peak_flops == 5e10 and m.device.memory_bandwidth_Bps == 1e10 and m.device.matmul_efficiency == 1
    assert measured_hardware(hw, RuntimeCosts()) is hw
    slow = _sim(_problem(2, RC), none_policy)
    assert slow.stages[-1].fwd_time_s > _sim(_problem(2, None), none_policy).stages[-1].fwd_time_s  # LM head on CPU
    prob = _problem(2, None)
    link = prob.hardware.link_for_group(2, 1)
    assert tied_embedding_sync_time(prob.model, prob.parallel, prob.hardware, 4.0) == \
        allreduce_time(1024 * 512 * 4.0, 2, link)
    untied = _problem(2, None, tie=False)
    assert tied_embedding_sync_time(untied.model, untied.parallel, untied.hardware, 4.0) == 0.0
    assert tied_embedding_sync_time(_problem(1, None).model, _problem(1, None).parallel, hw, 4.0) == 0.0
