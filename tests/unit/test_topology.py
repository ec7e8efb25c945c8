"""Topology-aware link selection, the all-gather efficiency, and --busbw."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lynx.cost.layer import build_layer_graph
from lynx.errors import SpecError
from lynx.models import load_model
from lynx.spec import GB, LinkSpec, ParallelSpec, hardware_from_dict, hardware_to_dict, load_hardware
from lynx.topology import Topology

# nvidia-smi topo -m of nccl-tests issue 178's node, one socket of it: NVLink-bridged pairs (0,1), (2,3);
# the pairs meet through PCIe host bridges ("NODE").
BRIDGED = """\
name: bridged
devices_per_node: 4
device: {name: A100-PCIE, memory_bytes: 42949672960, peak_flops: 3.12e+14, memory_bandwidth_Bps: 1.555e+12}
intra_node: {bandwidth_Bps: 3.0e+11, latency_s: 5.0e-6}
inter_node: {bandwidth_Bps: 1.25e+10, latency_s: 1.0e-5}
topology:
  links:
    NV12: {bandwidth_Bps: 3.0e+11, latency_s: 5.0e-6, efficiency: 0.7}
    NODE: {bandwidth_Bps: 3.2e+10, latency_s: 1.0e-5, efficiency: 0.6}
  matrix:
    - [X, NV12, NODE, NODE]
    - [NV12, X, NODE, NODE]
    - [NODE, NODE, X, NV12]
    - [NODE, NODE, NV12, X]
  dedicated: [NV12]
"""


def _comm_fwd(hw_name_or_hw: object, tp: int) -> float:
    hw = load_hardware(hw_name_or_hw) if isinstance(hw_name_or_hw, str) else hw_name_or_hw
    par = ParallelSpec(tp=tp, micro_batch_size=4, global_batch_size=4, seq_length=1024)
    g = build_layer_graph(load_model("gpt-7b"), hw, par)  # type: ignore[arg-type]
    return sum(o.fwd_time for o in g.comm_ops())


def test_hgx_4gpu_board_pairs_and_mesh() -> None:
    hw = load_hardware("a100-40g-nvlink")
    pair = hw.link_for_group(2)
    assert pair.bandwidth_Bps == 100 * GB  # 4 NVLink 3 links between two GPUs
    assert hw.link_for_group(4).bandwidth_Bps == 300 * GB  # a 4-GPU ring uses all 12 links of each GPU
    assert hw.link_for_group(2, stride=2).bandwidth_Bps == 100 * GB  # a strided DP/PP pair: one pair's links
    assert hw.link_for_group(8) is hw.inter_node
    assert hw.link_for_group(2, stride=4) is hw.inter_node


def test_a_ring_is_as_slow_as_its_slowest_pair(tmp_path: Path) -> None:
    f = tmp_path / "bridged.yaml"
    f.write_text(BRIDGED)
    hw = load_hardware(str(f))
    assert hw.link_for_group(2).bandwidth_Bps == 300 * GB  # TP 2 inside a bridged pair
    tp4 = hw.link_for_group(4)  # the ring 0-1-2-3 crosses the host bridge twice
    assert (tp4.bandwidth_Bps, tp4.efficiency) == (32 * GB, 0.6)
    assert hw.link_for_group(2, stride=2).bandwidth_Bps == 32 * GB  # DP pairs (0,2), (1,3)
    # and the cost model follows: TP 4's collectives take longer than TP 2's per byte moved
    assert _comm_fwd(hw, 4) > 5 * _comm_fwd(hw, 2)


def test_preset_topology_changes_predicted_comm_time() -> None:
    hw = load_hardware("a100-40g-nvlink")
    flat = dataclasses.replace(hw, topology=None)  # the old model: every group on the 300 GB/s intra link
    assert _comm_fwd(hw, 4) == pytest.approx(_comm_fwd(flat, 4))
    slow, fast = _comm_fwd(hw, 2), _comm_fwd(flat, 2)
    assert 2.5 < slow / fast < 3.0  # 3x the bandwidth term, the latency term unchanged


def test_sp_collectives_use_the_gather_efficiency() -> None:
    hw = load_hardware("a100-40g-nvlink")
    par = ParallelSpec(tp=4, sequence_parallel=True, micro_batch_size=4, global_batch_size=4, seq_length=1024)
    m = load_model("gpt-7b")
    lower = dataclasses.replace(hw, topology=dataclasses.replace(hw.topology, links=(  # type: ignore[arg-type]
        ("NV4", dataclasses.replace(hw.topology.link("NV4"), gather_efficiency=0.41)),)))  # type: ignore[union-attr]
    t = sum(o.fwd_time for o in build_layer_graph(m, hw, par).comm_ops())
    t_low = sum(o.fwd_time for o in build_layer_graph(m, lower, par).comm_ops())
    assert t_low > 1.8 * t


def test_busbw_sets_the_groups_efficiency() -> None:
    hw = load_hardware("a100-40g-nvlink")
    measured = hw.with_busbw(4, 1, 150 * GB)
    assert measured.link_for_group(4).efficiency == pytest.approx(0.5)
    assert measured.link_for_group(8) == hw.link_for_group(8)
    assert _comm_fwd(measured, 4) > 1.4 * _comm_fwd(hw, 4)
    pcie = load_hardware("a100-40g-pcie").with_busbw(2, 1, 16 * GB)
    assert pcie.link_for_group(2).efficiency == pytest.approx(0.5)
    legacy = load_hardware("ascend-910").with_busbw(4, 1, 15 * GB)
    assert legacy.intra_node.efficiency == pytest.approx(0.5) and legacy.inter_group == load_hardware(
        "ascend-910").inter_group
    with pytest.raises(SpecError, match="--busbw 400 GB/s.*300 GB/s"):
        hw.with_busbw(4, 1, 400 * GB)


def test_topology_validation_and_round_trip() -> None:
    link = LinkSpec(1e11, 5e-6)
    with pytest.raises(SpecError, match="not symmetric"):
        Topology((("A", link), ("B", link)), (("X", "A"), ("B", "X")))
    with pytest.raises(SpecError, match="names link 'C'"):
        Topology((("A", link),), (("X", "C"), ("C", "X")))
    with pytest.raises(SpecError, match="diagonal"):
        Topology((("A", link),), (("A", "A"), ("A", "A")))
    with pytest.raises(SpecError, match="gather_efficiency must be > 0 and <= 1"):
        LinkSpec(1e11, 5e-6, gather_efficiency=1.5)
    hw = load_hardware("a100-40g-nvlink")
    back = hardware_from_dict(hardware_to_dict(hw))
    assert back == hw and back.link_for_group(2) == hw.link_for_group(2)


def test_bad_topology_yaml_is_one_clear_error(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(BRIDGED.replace("- [X, NV12, NODE, NODE]", "- [X, NV12, NODE]"))
    with pytest.raises(SpecError, match="matrix row 0 has 3 entries"):
        load_hardware(str(f))
    f.write_text(BRIDGED.replace("  dedicated: [NV12]", "  ring: [NV12]"))
    with pytest.raises(SpecError, match="unknown field"):
        load_hardware(str(f))
