"""Activation offloading, the third choice beside keep and recompute: the copy model every part of lynx shares
(the HEU ILP's rows, the simulator's pricing, the baselines). docs/offload.md has the derivation.

An offloaded op output (`LayerPolicy.offload`) is copied device-to-host after its forward on the stage's D2H copy
stream, and host-to-device before its layer's backward on the H2D stream (Megatron-Core's fine-grained
activation offloading does the same, layer by layer). Per micro-batch a stage moves V bytes each way: V the
stage's offloaded bytes. In the 1F1B steady state a stage runs one forward and one backward per micro-batch
(its cycle, T_F + T_B), so:

* throughput: each copy stream must move V per cycle; what it cannot is exposed (the stage waits for the
  reload, or for the copy-out to free its buffer): ``max(0, V / BW_d2h - cycle, V / BW_h2d - cycle)``, and with
  one copy engine for both directions ``max(0, V (1 / BW_d2h + 1 / BW_h2d) - cycle)``;
* latency: micro-batch j's round trip must fit between its forward and its backward; on stage s j waits through
  p - s - 1 other forwards and backwards (the schedule's in-flight count f = min(p - s, m)), and the copies go
  layer by layer (a layer's copy-out starts when its forward ends, its reload must end before its backward
  starts: the layers above it run in between), so the window is ``W = (f - 1) cycle + cycle (n - 1) / n`` for
  n layers: ``max(0, V (1 / BW_d2h + 1 / BW_h2d) - W)``. On the last stage (f = 1) only the layer-wise overlap
  is left, and offloading there frees nothing (one micro-batch in flight is on the device anyway).

Interleaved stages (several model chunks per rank) move V = sum_k V_k, V_k chunk k's offloaded bytes: the
throughput bounds are the same on V (the rank's cycle runs every chunk once each way); each chunk has its own
round trip window. A rank's steady state alternates one chunk forward and one chunk backward (a step, on average
cycle / v for v chunks), and chunk k's micro-batch j waits through at least f_k - 1 steps between F_k(j) and
B_k(j) (f_k the chunk's in-flight count at its peak), so ``W_k = (f_k - 1) cycle / v + cycle (n_k - 1) / L``
(n_k of the rank's L layers in chunk k, the layer-wise overlap of its own forward and backward):
``max(0, V_k (1 / BW_d2h + 1 / BW_h2d) - W_k)`` for each chunk. Steps of the other chunks between F_k(j) and
B_k(j) only lengthen the window, so this is conservative.

The exposed time E (seconds per micro-batch) is the largest of these and 0. Bandwidths are the host link's per
GPU (`spec.HostLink.per_gpu`: every GPU of a node behind the same uplink copies at once in a pipeline stage).
"""

from __future__ import annotations

from dataclasses import dataclass

from lynx.decisions import LayerPolicy, StageContext
from lynx.graph import LayerGraph
from lynx.spec import Hardware


@dataclass(frozen=True, slots=True)
class OffloadLink:
    """What one GPU gets of its node's host link when every GPU offloads at once."""

    d2h_Bps: float
    h2d_Bps: float
    duplex: bool
    host_bytes: float
    """Pinned host memory this GPU may use for offloaded activations."""

    @property
    def round_trip_s_per_byte(self) -> float:
        return 1.0 / self.d2h_Bps + 1.0 / self.h2d_Bps


def offload_link(hw: Hardware) -> OffloadLink | None:
    """The per-GPU share of `hw`'s host link; None when the hardware has none (no offloading)."""
    link = hw.host()
    if link is None:
        return None
    d2h, h2d, host = link.per_gpu(hw.devices_per_node)
    return OffloadLink(d2h, h2d, link.duplex, host)


def stage_cycle(graph: LayerGraph, num_layers: int, subtract_wgrad: bool) -> tuple[float, float]:
    """(T_F, T_B): one micro-batch's forward and backward on the stage's layers, without recomputation (what
    copies can hide behind whatever the policy recomputes: the conservative part of the cycle)."""
    # the simulator's per-layer prices (`lynx.cost.stage.layer_cost`; a solver does not import it)
    fwd = graph.fwd_time()
    bwd = (sum(o.bwd_time for o in graph.ops if not o.is_comm)
           + graph.bwd_window("attn", subtract_wgrad) + graph.bwd_window("mlp", subtract_wgrad))
    return num_layers * fwd, num_layers * bwd


def exposure_rows(link: OffloadLink, t_fwd: float, t_bwd: float, in_flight: int,
                  num_layers: int) -> tuple[tuple[float, float], ...]:
    """The lower bounds E >= a * V - b of the exposed copy time, as (a, b) pairs (V in bytes per micro-batch)."""
    cycle = t_fwd + t_bwd
    window = (max(1, in_flight) - 1) * cycle + cycle * (num_layers - 1) / max(1, num_layers)
    rows = [(link.round_trip_s_per_byte, window)]
    if link.duplex:
        rows += [(1.0 / link.d2h_Bps, cycle), (1.0 / link.h2d_Bps, cycle)]
    else:
        rows.append((link.round_trip_s_per_byte, cycle))
    return tuple(rows)


def chunk_exposure_rows(link: OffloadLink, t_fwd: float, t_bwd: float, in_flight: tuple[int, ...],
                        layers: tuple[int, ...]) -> tuple[tuple[tuple[float, ...], float], ...]:
    """The lower bounds E >= sum_k w_k V_k - b of an interleaved stage's exposed copy time (module docstring), as
    (per-chunk weights w, b) pairs: the throughput rows weigh every chunk alike, each chunk's round trip only its
    own bytes."""
    cycle = t_fwd + t_bwd
    total, chunks = max(1, sum(layers)), len(layers)
    step = cycle / chunks
    rows: list[tuple[tuple[float, ...], float]] = []
    for k, (f, n) in enumerate(zip(in_flight, layers, strict=True)):
        w = tuple(link.round_trip_s_per_byte if i == k else 0.0 for i in range(chunks))
        rows.append((w, (max(1, f) - 1) * step + cycle * (max(1, n) - 1) / total))
    for a, b in exposure_rows(link, t_fwd, t_bwd, 1, 1)[1:] if link.duplex else ((link.round_trip_s_per_byte,
                                                                                  cycle),):
        rows.append(((a,) * chunks, b))
    return tuple(rows)


def exposed_copy_time(volume: float, link: OffloadLink | None, t_fwd: float, t_bwd: float, in_flight: int,
                      num_layers: int) -> float:
    """Seconds per micro-batch the stage waits for its copies (module docstring)."""
    if volume <= 0:
        return 0.0
    if link is None:
        raise ValueError("the plan offloads activations but the hardware has no host link")
    return max(0.0, *(a * volume - b for a, b in exposure_rows(link, t_fwd, t_bwd, in_flight, num_layers)))


def offloaded_bytes(graph: LayerGraph, layers: tuple[LayerPolicy, ...]) -> float:
    """V: bytes one micro-batch of the stage offloads (each way)."""
    return sum(graph.keep_bytes(n) for lp in layers for n in lp.offload)


def stage_exposed_copy(graph: LayerGraph, layers: tuple[LayerPolicy, ...], ctx: StageContext,
                       link: OffloadLink | None) -> float:
    """E of a stage policy: its copies' exposed seconds per micro-batch (the simulator charges it before each
    backward, HEU's objective counts it)."""
    v = offloaded_bytes(graph, layers)
    if v <= 0:
        return 0.0
    t_fwd, t_bwd = stage_cycle(graph, len(layers), ctx.subtract_wgrad)
    if ctx.chunk_layers:  # interleaved: each chunk's own round trip window
        if link is None:
            raise ValueError("the plan offloads activations but the hardware has no host link")
        vk = [offloaded_bytes(graph, layers[lo:hi]) for lo, hi in ctx.chunk_slices()]
        rows = chunk_exposure_rows(link, t_fwd, t_bwd, chunk_in_flight(ctx), ctx.chunk_layers)
        return max(0.0, *(sum(w * x for w, x in zip(ws, vk, strict=True)) - b for ws, b in rows))
    return exposed_copy_time(v, link, t_fwd, t_bwd, ctx.in_flight, len(layers))


def chunk_in_flight(ctx: StageContext) -> tuple[int, ...]:
    """Each chunk's in-flight micro-batches at its peak (the largest over the schedule's live vectors)."""
    vectors = ctx.live_vectors or (ctx.chunk_in_flight,)
    return tuple(max(vec[k] for vec in vectors) for k in range(ctx.num_chunks))


def copy_times(graph: LayerGraph, layers: tuple[LayerPolicy, ...], link: OffloadLink | None) -> tuple[float, float]:
    """(copy-out, reload) seconds of one micro-batch's offloaded bytes on their streams (the Gantt chart's bars)."""
    v = offloaded_bytes(graph, layers)
    if v <= 0 or link is None:
        return 0.0, 0.0
    return v / link.d2h_Bps, v / link.h2d_Bps
