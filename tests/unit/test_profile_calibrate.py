"""Calibration recovers known efficiency factors from a synthetic profile, and reports per op."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lynx.cost.layer import CostParams, build_layer_graph
from lynx.models import load_model
from lynx.profile.calibrate import calibrate, nominal_hardware, preset_for_device
from lynx.profile.errors import ProfileError
from lynx.profile.store import OpStats, ProfileRecord, RunInfo
from lynx.spec import ParallelSpec, load_hardware

INFO = RunInfo("gpt-7b", "bf16", "some accelerator", "2.x", "0.1.0", "3.11")


def _record(true: CostParams, tp: int, hw_name: str = "a100-40g-nvlink") -> ProfileRecord:
    par = ParallelSpec(tp=tp, micro_batch_size=4, global_batch_size=4, seq_length=2048)
    g = build_layer_graph(load_model("gpt-7b"), load_hardware(hw_name), par, true)
    g = replace(g, meta=replace(g.meta, source="profile:1"))
    ops = tuple(OpStats(o.name, o.fwd_time, 0.0, o.bwd_time, 0.0) for o in g.ops)
    return ProfileRecord(1, INFO, g, ops, {})


@pytest.mark.parametrize("tp", [1, 4])
def test_recovers_known_factors(tp: int) -> None:
    true = CostParams(matmul_efficiency=0.55, memory_efficiency=0.4, comm_efficiency_scale=0.5,
                      kernel_overhead_s=8e-6)
    cal = calibrate(_record(true, tp), "a100-40g-nvlink")
    assert cal.after.matmul_efficiency == pytest.approx(0.55, rel=0.03)
    assert cal.after.memory_efficiency == pytest.approx(0.4, rel=0.05)
    assert cal.after.kernel_overhead_s == pytest.approx(8e-6, rel=0.25)
    if tp > 1:
        assert cal.after.comm_efficiency_scale == pytest.approx(0.5, rel=0.05)
    else:
        assert cal.after.comm_efficiency_scale == 1.0 and cal.notes
    assert cal.error_after < 0.02 < cal.error_before
    by = {f.name: f for f in cal.ops}
    assert by["fc1"].after_fwd == pytest.approx(by["fc1"].measured_fwd, rel=0.03)
    assert by["fc1"].before_fwd < by["fc1"].measured_fwd  # the preset's 0.75 is faster than 0.55


def test_default_hardware_needs_measured_peaks() -> None:
    rec = _record(CostParams(0.5, 0.5), 1)
    with pytest.raises(ProfileError, match="no measured device peaks"):
        calibrate(rec)
    rec = replace(rec, extra={"device_peak_flops": 312e12, "device_mem_bw_Bps": 1.555e12})
    cal = calibrate(rec)
    assert cal.hardware_name.startswith("host:")


def test_gpu_profiles_use_the_matching_preset() -> None:
    assert preset_for_device("NVIDIA H100 80GB HBM3") == "h100-80g-nvlink"
    assert preset_for_device("NVIDIA A100-SXM4-40GB") == "a100-40g-nvlink"
    assert preset_for_device("NVIDIA A100-PCIE-40GB") == "a100-40g-pcie"
    assert preset_for_device("cpu: AMD EPYC") is None
    rec = _record(CostParams(0.5, 0.5), 1)
    rec = replace(rec, info=replace(rec.info, device="NVIDIA A100-SXM4-40GB"))
    assert calibrate(rec).hardware_name == "a100-40g-nvlink"


def test_nominal_hardware_is_a_valid_spec() -> None:
    hw = nominal_hardware("cpu: test", 1e11, 2e10)
    assert hw.device.peak_flops == 1e11 and hw.link_for_group(2).bandwidth_Bps == 10e9
