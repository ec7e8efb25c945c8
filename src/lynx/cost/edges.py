"""Work outside the transformer layers, priced once for the partitioners and the simulator (so a partition is
balanced on the prices it is judged by): on the plan's hardware, or for a graph measured on a runtime (a CPU
profile) on its device's measured rates."""

from __future__ import annotations

from lynx.cost.layer import EdgeTimes, edge_times
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
    simulator charges and what the partitioners balance."""
    return edge_times(model, device_hardware(hardware, graph), par)
