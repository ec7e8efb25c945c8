"""The analytic cost model gives physically sane numbers."""

from __future__ import annotations

import dataclasses

import pytest

from lynx.cost.collectives import allreduce_time, gather_time
from lynx.cost.layer import build_layer_graph, model_flops_per_iteration
from lynx.models import load_model
from lynx.spec import ParallelSpec, load_hardware


def _g(tp: int = 4, mb: int = 8, hw: str = "a100-40g-nvlink", model: str = "gpt-7b", sp: bool = False):  # type: ignore[no-untyped-def]
    par = ParallelSpec(tp=tp, micro_batch_size=mb, global_batch_size=mb, seq_length=1024, sequence_parallel=sp)
    return build_layer_graph(load_model(model), load_hardware(hw), par)


def test_gemm_time_is_flops_over_effective_peak() -> None:
    g = _g()
    hw = load_hardware("a100-40g-nvlink")
    fc1 = g.op("fc1")
    # [8192 tokens, 4096] @ [4096, 4096]: 2 * 8192 * 4096 * 4096 FLOPs at 75% of 312 TFLOP/s.
    ideal = 2 * 8192 * 4096 * 4096 / (hw.device.peak_flops * hw.device.matmul_efficiency)
    assert fc1.fwd_time == pytest.approx(ideal, rel=0.01)
    assert fc1.bwd_time == pytest.approx(2 * fc1.fwd_time)
    assert fc1.wgrad_time == pytest.approx(fc1.fwd_time)


def test_layer_times_are_in_the_known_range() -> None:
    # A GPT-7B layer, TP 4, micro-batch 8 x 1024 tokens: ~ 6 GFLOP-class per token-layer / 4 GPUs; a few ms.
    g = _g()
    assert 2e-3 < g.fwd_time() < 20e-3
    assert 1.5 < g.bwd_time() / g.fwd_time() < 2.5


def test_allreduce_alpha_beta() -> None:
    link = load_hardware("a100-40g-nvlink").intra_node
    nbytes = 64 * 2**20
    t = allreduce_time(nbytes, 4, link)
    assert t == pytest.approx(6 * link.latency_s + 1.5 * nbytes / (link.bandwidth_Bps * link.efficiency))
    assert allreduce_time(nbytes, 1, link) == 0.0
    # all-gather / reduce-scatter: half the traffic, at the link's own (measured) efficiency
    assert gather_time(nbytes, 4, link) == pytest.approx(
        3 * link.latency_s + 0.75 * nbytes / (link.bandwidth_Bps * link.gather_eff))
    assert link.gather_eff != link.efficiency
    same = dataclasses.replace(link, gather_efficiency=None)
    assert gather_time(nbytes, 4, same) == pytest.approx(t / 2)


def test_no_tp_means_no_collective_time() -> None:
    g = _g(tp=1)
    assert all(o.fwd_time == 0 and o.bwd_time == 0 for o in g.comm_ops())


def test_slower_links_give_longer_windows() -> None:
    nv, pcie = _g(tp=2, hw="a100-40g-nvlink"), _g(tp=2, hw="a100-40g-pcie")
    # A TP-2 pair on the 4-GPU NVLink board has 4 NVLinks (100 GB/s x 0.8) against PCIe's 32 GB/s x 0.7.
    assert pcie.fwd_window("attn") > 3 * nv.fwd_window("attn")
    # PCIe windows are long enough that the backward all-reduce outlasts the wgrad GEMM.
    assert pcie.bwd_window("mlp") > 0
    assert pcie.bwd_window("mlp", subtract_wgrad=False) > pcie.bwd_window("mlp")


def test_tp_across_nodes_uses_the_inter_node_link() -> None:
    inside = _g(tp=4, hw="a100-40g-nvlink")
    across = _g(tp=8, hw="a100-40g-nvlink")
    assert across.fwd_window("mlp") > 10 * inside.fwd_window("mlp")


def test_sequence_parallel_halves_each_collective() -> None:
    g, gs = _g(tp=4), _g(tp=4, sp=True)
    # all-gather + reduce-scatter move what one all-reduce moves, at the link's gather efficiency
    link = load_hardware("a100-40g-nvlink").link_for_group(4)
    ratio = link.efficiency / link.gather_eff
    assert gs.fwd_window("attn") == pytest.approx(g.fwd_window("attn") * ratio, rel=0.01)
    assert len(gs.comm_ops()) == 2 * len(g.comm_ops())


def test_model_flops_match_narayanan_formula() -> None:
    m = load_model("gpt-175b")
    par = ParallelSpec(micro_batch_size=1, global_batch_size=1536, seq_length=2048)
    B, s, L, h, V = 1536, 2048, m.num_layers, m.hidden_size, m.vocab_size
    # Narayanan et al. 2021, eq. 3 counts 96 B s l h^2 (1 + s/6h + V/16lh) with full recomputation; the
    # recomputed forward is 24 B s l h^2 (1 + s/6h) of it (the LM head is not recomputed).
    with_recompute = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    narayanan = with_recompute - 24 * B * s * L * h * h * (1 + s / (6 * h))
    assert model_flops_per_iteration(m, par) == pytest.approx(narayanan, rel=0.01)
