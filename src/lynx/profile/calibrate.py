"""Fit the analytic cost model's efficiency factors (`CostParams`) to a stored profile. No torch.

The cost model predicts a compute op's forward as ``overhead + max(F / (peak * matmul_eff),
B / (bandwidth * memory_eff))`` and its backward as twice that; collectives as alpha-beta over the TP link
scaled by ``comm_efficiency_scale``. Per op FLOPs ``F`` and bytes ``B`` come from the cost model itself (built
once with a huge matmul efficiency, so that its times are ``B / bandwidth``), so this module repeats no
formula. The fit minimises the squared log error of forward and backward times over compute ops (a grid
over matmul and memory efficiency and kernel overhead, then three zoomed grids around the best point), then
the scale of the collectives on comm ops (1-D grid). Peaks come from ``--hardware``, else the preset named by
the device (A100, H100), else the GEMM and copy rates the profiler measured on the device (a CPU has no
datasheet peak worth the name).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
from rich.table import Table

from lynx.cost.layer import CostParams, build_layer_graph
from lynx.graph import LayerGraph
from lynx.profile.errors import ProfileError
from lynx.profile.store import ProfileRecord
from lynx.spec import DeviceSpec, Hardware, LinkSpec, ModelSpec, ParallelSpec, load_hardware


def nominal_hardware(device_name: str, peak_flops: float, mem_bw: float, link_bw: float = 10e9) -> Hardware:
    """A `Hardware` for a device without a preset (a CPU): the peaks are the profiler's measured GEMM and copy
    rates; the link is loopback TCP, nominally 10 GB/s and 20 us (the comm scale absorbs the difference)."""
    dev = DeviceSpec(name=device_name, memory_bytes=64e9, peak_flops=peak_flops, memory_bandwidth_Bps=mem_bw,
                     reserved_bytes=1e9)
    link = LinkSpec(bandwidth_Bps=link_bw, latency_s=20e-6)
    return Hardware(name=f"host:{device_name}", device=dev, devices_per_node=64, intra_node=link,
                    inter_node=link, max_nodes=1)


def specs_of(graph: LayerGraph) -> tuple[ModelSpec, ParallelSpec]:
    from lynx.families import get_family

    m = graph.meta
    # dropout: an op outside norms and core attention whose backward reads its own side state (a mask)
    dropout = any(o.name in o.saved and o.module not in ("layernorm", "core_attn") for o in graph.ops)
    fields = {**get_family(m.family).defaults, "family": m.family, "dropout": dropout}
    model = ModelSpec(name=m.model or "profiled", num_layers=1, hidden_size=m.hidden_size,
                      num_attention_heads=m.num_attention_heads, ffn_hidden_size=m.ffn_hidden_size,
                      num_query_groups=m.num_query_groups, **fields)
    par = ParallelSpec(tp=m.tp, sequence_parallel=m.sequence_parallel, micro_batch_size=m.micro_batch_size,
                       global_batch_size=m.micro_batch_size, seq_length=m.seq_length)
    return model, par


@dataclass(frozen=True)
class OpFit:
    name: str
    kind: str
    measured_fwd: float
    measured_bwd: float
    before_fwd: float
    before_bwd: float
    after_fwd: float
    after_bwd: float


@dataclass(frozen=True)
class Calibration:
    profile_id: int
    hardware_name: str
    before: CostParams
    after: CostParams
    ops: tuple[OpFit, ...]
    error_before: float
    """Typical factor by which predictions miss, ``exp(rms(log(predicted / measured))) - 1`` over ops and
    directions (compute ops; comm ops too with TP > 1), with the hardware's default factors."""
    error_after: float
    """The same with the fitted factors (the quantity the fit minimises)."""
    notes: tuple[str, ...] = ()
    created_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))

    def params_dict(self) -> dict[str, float]:
        return asdict(self.after)

    def to_dict(self) -> dict[str, Any]:
        return {"profile_id": self.profile_id, "hardware": self.hardware_name, "before": asdict(self.before),
                "after": asdict(self.after), "error_before": self.error_before, "error_after": self.error_after,
                "ops": [asdict(o) for o in self.ops], "notes": list(self.notes), "created_at": self.created_at}


def preset_for_device(device: str) -> str | None:
    """The hardware preset whose device a CUDA device name denotes ("NVIDIA A100-SXM4-40GB" -> a100 NVLink)."""
    d = device.lower()
    for key, preset in (("h100", "h100-80g-nvlink"), ("a100-pcie", "a100-40g-pcie"), ("a100", "a100-40g-nvlink")):
        if key in d:
            return preset
    return None


def _hardware_for(rec: ProfileRecord, hardware: str | None) -> Hardware:
    hardware = hardware or preset_for_device(rec.info.device)
    if hardware is not None:
        return load_hardware(hardware)
    peak, bw = rec.extra.get("device_peak_flops"), rec.extra.get("device_mem_bw_Bps")
    if not peak or not bw:
        raise ProfileError(f"profile {rec.id} has no measured device peaks; pass --hardware")
    return nominal_hardware(rec.info.device, float(peak), float(bw))


def _log_err(pairs: list[tuple[float, float]]) -> float:
    logs = [np.log(p / m) for p, m in pairs if m > 0 and p > 0]
    return float(np.exp(np.sqrt(np.mean(np.square(logs)))) - 1.0) if logs else 0.0


def _fit_compute(flops: np.ndarray, nbytes: np.ndarray, ratio: np.ndarray, fwd: np.ndarray, bwd: np.ndarray,
                 hw: Hardware, start: CostParams) -> tuple[float, float, float]:
    """Grid search, then zoomed grids, of (matmul_eff, memory_eff, overhead) on squared log error; the
    starting factors stay if nothing on the grids beats them."""
    peak, bw = hw.device.peak_flops, hw.device.memory_bandwidth_Bps
    meas = np.log(np.concatenate([fwd, bwd]))

    def loss(E: np.ndarray, B: np.ndarray, K: np.ndarray) -> np.ndarray:
        t = K[..., None] + np.maximum(flops / (peak * E[..., None]), nbytes / (bw * B[..., None]))
        pred = np.log(np.concatenate([t, t * ratio], axis=-1))
        out: np.ndarray = ((pred - meas) ** 2).sum(-1)
        return out

    def search(em: np.ndarray, eb: np.ndarray, ko: np.ndarray) -> tuple[float, float, float]:
        L = loss(*np.meshgrid(em, eb, ko, indexing="ij"))
        i = np.unravel_index(int(np.argmin(L)), L.shape)
        return float(em[i[0]]), float(eb[i[1]]), float(ko[i[2]])

    em, eb, ko = search(np.geomspace(1e-3, 2.0, 60), np.geomspace(1e-3, 2.0, 60),
                        np.concatenate([[0.0], np.geomspace(1e-7, 1e-3, 25)]))
    for f in (1.3, 1.08, 1.02):  # zoom in around the best point
        k = max(ko, 1e-7)
        em, eb, ko = search(np.geomspace(em / f, em * f, 21), np.geomspace(eb / f, eb * f, 21),
                            np.concatenate([[0.0], np.geomspace(k / f**3, k * f**3, 21)]))
    s = start
    one = np.ones(1)
    if loss(one * s.matmul_efficiency, one * s.memory_efficiency, one * s.kernel_overhead_s)[0] < \
            loss(one * em, one * eb, one * ko)[0]:
        return s.matmul_efficiency, s.memory_efficiency, s.kernel_overhead_s
    return em, eb, ko


def calibrate(rec: ProfileRecord, hardware: str | None = None) -> Calibration:
    hw = _hardware_for(rec, hardware)
    model, par = specs_of(rec.graph)
    before = CostParams.for_hardware(hw)
    # FLOPs from the graph; bytes recovered from a build whose matmul term vanishes and overhead is zero.
    probe = build_layer_graph(model, hw, par, CostParams(1e15, 1.0, 1.0, 0.0))
    meas = {o.name: o for o in rec.graph.ops}
    if [o.name for o in probe.ops] != list(meas):
        raise ProfileError(f"profile {rec.id}: its ops do not match the cost model's graph of the same shape")
    comp = [o for o in probe.ops if not o.is_comm and meas[o.name].fwd_time > 0 and meas[o.name].bwd_time > 0]
    if len(comp) < 3:
        raise ProfileError(f"profile {rec.id}: too few measured compute ops to calibrate")
    flops = np.array([o.fwd_flops for o in comp])
    nbytes = np.array([o.fwd_time * hw.device.memory_bandwidth_Bps for o in comp])
    ratio = np.array([o.bwd_time / o.fwd_time for o in comp])
    em, eb, ko = _fit_compute(flops, nbytes, ratio, np.array([meas[o.name].fwd_time for o in comp]),
                              np.array([meas[o.name].bwd_time for o in comp]), hw, before)
    notes: list[str] = []
    scale = before.comm_efficiency_scale
    comm = [o for o in rec.graph.ops if o.is_comm and o.fwd_time > 0]
    if rec.graph.meta.tp > 1 and comm:
        grid = np.append(np.geomspace(1e-3, 1.0 / hw.intra_node.efficiency, 120), scale)
        losses = []
        for s in grid:
            g = build_layer_graph(model, hw, par, CostParams(em, eb, float(s), ko))
            losses.append(sum((np.log(g.op(o.name).fwd_time) - np.log(o.fwd_time)) ** 2
                              + (np.log(g.op(o.name).bwd_time) - np.log(max(o.bwd_time, 1e-9))) ** 2
                              for o in comm))
        scale = float(grid[int(np.argmin(losses))])
    else:
        notes.append("TP 1: no collective ran, comm_efficiency_scale left at its default")
    after = CostParams(em, eb, scale, ko)
    g0 = build_layer_graph(model, hw, par, before)
    g1 = build_layer_graph(model, hw, par, after)
    fits = tuple(OpFit(o.name, o.kind, o.fwd_time, o.bwd_time, g0.op(o.name).fwd_time, g0.op(o.name).bwd_time,
                       g1.op(o.name).fwd_time, g1.op(o.name).bwd_time) for o in rec.graph.ops)
    scored = [f for f in fits if f.kind == "compute" or rec.graph.meta.tp > 1]
    err0 = _log_err([(f.before_fwd, f.measured_fwd) for f in scored]
                    + [(f.before_bwd, f.measured_bwd) for f in scored])
    err1 = _log_err([(f.after_fwd, f.measured_fwd) for f in scored]
                    + [(f.after_bwd, f.measured_bwd) for f in scored])
    return Calibration(rec.id, hw.name, before, after, fits, err0, err1, tuple(notes))


def report_table(cal: Calibration) -> Table:
    t = Table(title=f"profile {cal.profile_id} vs the cost model on {cal.hardware_name}: ms, predicted "
                    "(error vs measured) before and after calibration")
    for col in ("op", "measured fwd", "before", "after", "measured bwd", "before", "after"):
        t.add_column(col, justify="left" if col == "op" else "right")

    def cell(p: float, m: float) -> str:
        return f"{p * 1e3:.2f} ({(p - m) / m:+.0%})" if m > 0 else f"{p * 1e3:.2f}"

    for f in cal.ops:
        t.add_row(f.name, f"{f.measured_fwd * 1e3:.2f}", cell(f.before_fwd, f.measured_fwd),
                  cell(f.after_fwd, f.measured_fwd), f"{f.measured_bwd * 1e3:.2f}",
                  cell(f.before_bwd, f.measured_bwd), cell(f.after_bwd, f.measured_bwd))
    return t
