"""Work outside the transformer layers, priced once for the partitioners and the simulator (so a partition is
balanced on the prices it is judged by): on the plan's hardware, or for a graph measured on a runtime (a CPU
profile) on its device's measured rates."""

from __future__ import annotations

from dataclasses import replace

from lynx.cost.layer import EdgeTimes, edge_times, mtp_times
from lynx.graph import LayerGraph
from lynx.spec import Hardware, ModelSpec, ParallelSpec


def device_hardware(hardware: Hardware, graph: LayerGraph) -> Hardware:
    """The hardware that prices work outside the layer graph (embedding, LM head, loss, optimizer): the plan's,
    or with a graph that carries measured runtime costs (a CPU profile), its device's measured rates."""
    from lynx.cost.runtime import measured_hardware

    rc = graph.runtime
    return hardware if rc is None else measured_hardware(hardware, rc)


def stage_edge_times(model: ModelSpec, hardware: Hardware, par: ParallelSpec, graph: LayerGraph) -> EdgeTimes:
    """Embedding (first stage) and LM head + loss (last stage) per micro-batch, on `device_hardware`: what the
    simulator charges and what the partitioners balance. The last stage's head includes DeepSeek-V3's
    multi-token-prediction layers (`mtp_times`; their transformer layer priced as `graph`, the model's primary
    kind, which is its last layer's in every preset)."""
    hw = device_hardware(hardware, graph)
    et = edge_times(model, hw, par)
    if not model.mtp_num_layers:
        return et
    fwd, bwd = mtp_times(model, hw, par, graph.fwd_time(), graph.bwd_time(), et)
    return replace(et, head_fwd=et.head_fwd + fwd, head_bwd=et.head_bwd + bwd)
