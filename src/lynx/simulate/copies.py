"""Offload copies in the simulator (docs/offload.md): each stage's offloaded activations go out on the D2H copy
stream after every forward and come back on the H2D stream before every backward, at the GPU's share of the
node's host link (`lynx.policy.offload`). What the streams cannot hide behind the stage's compute is charged
before each backward (the backward waits for its reload); the Gantt chart gets one bar per copy."""

from __future__ import annotations

from lynx.cost.memory import host_bytes, layer_memory
from lynx.decisions import RecomputePolicy, StageContext
from lynx.graph import LayerGraph
from lynx.policy.offload import OffloadLink, copy_times, offloaded_bytes
from lynx.simulate.results import Segment, SegmentKind


def stage_offload_bytes(graph: LayerGraph, pol: RecomputePolicy, ctx: StageContext) -> tuple[float, float]:
    """(bytes one micro-batch offloads, host bytes the stage pins) of one stage."""
    return offloaded_bytes(graph, pol.layers), host_bytes([layer_memory(graph, lp) for lp in pol.layers], ctx)


def copy_segments(graph: LayerGraph, pols: tuple[RecomputePolicy, ...], link: OffloadLink | None,
                  segments: tuple[Segment, ...] | list[Segment]) -> list[Segment]:
    """The copy bars of a recorded timeline: a copy-out from each forward's start (the layers' outputs go out
    as they are produced) and a reload ending where its backward starts, each as long as the stream takes,
    queued behind the stream's previous copy."""
    times = [copy_times(graph, p.layers, link) for p in pols]
    out: list[Segment] = []
    free_out = [0.0] * len(pols)
    for s in sorted((s for s in segments if s.kind in (SegmentKind.F, SegmentKind.B)), key=lambda s: s.start):
        t_out, t_in = times[s.stage]
        if s.kind is SegmentKind.F and t_out > 0:
            start = max(s.start, free_out[s.stage])
            free_out[s.stage] = start + t_out
            out.append(Segment(s.stage, SegmentKind.COPY_OUT, s.microbatch, start, start + t_out, s.chunk))
        elif s.kind is SegmentKind.B and t_in > 0:
            out.append(Segment(s.stage, SegmentKind.RELOAD, s.microbatch, s.start - t_in, s.start, s.chunk))
    return out
