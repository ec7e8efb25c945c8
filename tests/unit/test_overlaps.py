"""Megatron-Core's communication overlaps (--overlap-grad-reduce, --overlap-param-gather, --tp-comm-overlap),
kernel efficiency by shape, the multi-NIC link of a DP group, and the one price list solvers and simulator share."""

from __future__ import annotations

import dataclasses

import pytest

from lynx.api import make_problem, plan
from lynx.cost.dp_overlap import DpSync
from lynx.cost.kernels import KernelCurves
from lynx.cost.layer import CostParams, build_layer_graph
from lynx.cost.pricing import op_recompute_cost
from lynx.cost.pricing import recompute_time as sim_recompute_time
from lynx.errors import SpecError
from lynx.graph import RuntimeCosts
from lynx.models import load_model
from lynx.policy.heu_objective import recompute_time as heu_recompute_time
from lynx.policy.rules import full_layer
from lynx.problem import PlanOptions
from lynx.spec import ModelSpec, ParallelSpec, load_hardware

H100 = "h100-80g-nvlink"


def _par(tp: int = 8, sp: bool = True, dp: int = 1, pp: int = 1, gb: int = 8) -> ParallelSpec:
    return ParallelSpec(tp=tp, pp=pp, dp=dp, sequence_parallel=sp, micro_batch_size=1, global_batch_size=gb,
                        seq_length=4096)


def test_tp_comm_overlap_shrinks_each_sp_collective_and_keeps_its_rerun_time() -> None:
    m, hw, par = load_model("llama3-70b"), load_hardware(H100), _par()
    plain = build_layer_graph(m, hw, par)
    ub = build_layer_graph(m, hw, par, CostParams.for_hardware(hw, tp_comm_overlap=True))
    for o in plain.ops:
        if not o.is_comm:
            assert ub.op(o.name) == o  # compute untouched
            continue
        u = ub.op(o.name)
        assert 0 < u.fwd_time < o.fwd_time           # only what the pipelining leaves is idle
        assert u.recompute_time == pytest.approx(o.fwd_time)  # a recomputed forward runs without userbuffers
    assert ub.fwd_window("attn") < plain.fwd_window("attn") / 2
    assert ub.fwd_time() < plain.fwd_time()


def test_tp_comm_overlap_needs_sp_and_param_gather_needs_distributed_optimizer() -> None:
    m, hw = load_model("llama3-8b"), load_hardware(H100)
    with pytest.raises(SpecError, match="--tp-comm-overlap needs sequence parallelism"):
        make_problem(m, hw, _par(tp=2, sp=False), PlanOptions(tp_comm_overlap=True))
    with pytest.raises(SpecError, match="--overlap-param-gather needs --distributed-optimizer"):
        make_problem(m, hw, _par(tp=2), PlanOptions(overlap_param_gather=True))


def test_dp_sync_exposed_is_what_outlasts_the_compute_and_at_least_one_bucket() -> None:
    s = DpSync(grad_s=1.0, grad_bucket_s=0.1, param_s=0.5, param_bucket_s=0.05)
    assert s.exposed(False, False, 10.0, 10.0) == pytest.approx(1.5)
    assert s.exposed(True, False, 0.3, 10.0) == pytest.approx(0.7 + 0.5)
    assert s.exposed(True, True, 10.0, 10.0) == pytest.approx(0.1 + 0.05)  # last / first bucket never hides
    assert s.exposed(True, True, 0.3, 0.2) == pytest.approx(0.7 + 0.3)


def test_overlapping_dp_communication_shortens_the_iteration_only_by_what_it_hides() -> None:
    m, hw = load_model("llama3-8b"), load_hardware(H100)
    par = _par(tp=2, dp=8, gb=32)
    base = PlanOptions(precision="megatron-bf16", distributed_optimizer=True, nodes=2)
    t0 = plan(make_problem(m, hw, par, base), "none", record=False).sim
    t1 = plan(make_problem(m, hw, par, dataclasses.replace(base, overlap_grad_reduce=True,
                                                          overlap_param_gather=True)), "none", record=False).sim
    assert t1.pipeline_time_s == pytest.approx(t0.pipeline_time_s)
    tail0 = t0.iteration_time_s - t0.pipeline_time_s
    tail1 = t1.iteration_time_s - t1.pipeline_time_s
    assert 0 < tail1 < tail0


def test_gemm_efficiency_by_shape_thin_tp8_gemms_are_slower() -> None:
    dev = load_hardware(H100).device
    c = KernelCurves.of(dev)
    wide = c.gemm(4096, 8192, 28672 / 2)   # Llama-3-70B gate/up at TP 2
    thin = c.gemm(4096, 8192, 28672 / 8)   # ... at TP 8
    assert thin < wide < dev.matmul_efficiency
    flat = KernelCurves.of(dataclasses.replace(dev, gemm_half_dim=0.0))
    assert flat.gemm(16, 16, 16) == flat.gemm(1e5, 1e5, 1e5) == dev.matmul_efficiency
    assert c.flash(4096, 128, backward=True) < c.flash(4096, 128, backward=False)
    assert c.flash(1024, 128, backward=False) < c.flash(8192, 128, backward=False)
    assert c.flash(4096, 64, backward=False) < c.flash(4096, 128, backward=False)


def test_a_dp_group_with_several_members_per_node_uses_their_nics() -> None:
    hw = load_hardware(H100)  # 8 NICs per node, one per GPU
    one = hw.link_for_group(16, 8)   # TP 8: one member per node, one NIC
    four = hw.link_for_group(16, 2)  # TP 2: four members per node share four NICs
    assert one.bandwidth_Bps == hw.inter_node.bandwidth_Bps
    assert four.bandwidth_Bps == pytest.approx(4 * hw.inter_node.bandwidth_Bps)
    a100 = load_hardware("a100-40g-nvlink")  # one NIC per node: unchanged
    assert a100.link_for_group(8, 1).bandwidth_Bps == a100.inter_node.bandwidth_Bps


def test_heu_and_the_simulator_charge_the_same_restore_price() -> None:
    """One price function (`lynx.cost.pricing.recompute_time`) serves both; its price includes the restore."""
    m = ModelSpec(name="t", num_layers=4, hidden_size=256, num_attention_heads=4)
    g = build_layer_graph(m, load_hardware(H100), _par(tp=1, sp=False))
    g = dataclasses.replace(g, runtime=RuntimeCosts(restore_op_s=1e-3))
    lp = full_layer(g)
    phases = tuple({p for _, p in lp.recompute})
    n = len(lp.recomputed(phases))
    assert heu_recompute_time is sim_recompute_time
    assert heu_recompute_time(g, lp, phases) == pytest.approx(
        sum(g.op(x).fwd_time for x in lp.recomputed(phases)) + n * 1e-3)
    assert op_recompute_cost(g, "qkv") == pytest.approx(g.op("qkv").fwd_time + 1e-3)
