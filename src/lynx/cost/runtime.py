"""Pricing what the runtime spends beyond the layer's ops, for graphs that carry measured `RuntimeCosts`
(profiled on a CPU, docs/runtime-overhead.md); analytic graphs carry none and are priced as before.

* The recompute engine's own time per restored op (`pricing.recompute_time` adds it per recomputed op).
* The embedding, the LM head with its loss, and the optimizer step at the profiled device's measured GEMM rate
  and copy bandwidth, instead of the plan's hardware preset (which describes a GPU the profile did not run on).
* With PP > 1 and a tied LM head, the word-embedding gradient all-reduce between the first and the last stage
  (Megatron's embedding group; `lynx train` does the same) over the pipeline's link, after both are done.
"""

from __future__ import annotations

from dataclasses import replace

from lynx.cost.collectives import allreduce_time
from lynx.graph import RuntimeCosts
from lynx.spec import Hardware, ModelSpec, ParallelSpec


def measured_hardware(hw: Hardware, rc: RuntimeCosts) -> Hardware:
    """`hw` with its device's peaks replaced by the measured rates (reached in full: they are measured)."""
    dev = hw.device
    flops = rc.gemm_flops or dev.peak_flops
    bw = rc.memory_bw_Bps or dev.memory_bandwidth_Bps
    if flops == dev.peak_flops and bw == dev.memory_bandwidth_Bps:
        return hw
    return replace(hw, device=replace(dev, peak_flops=flops, memory_bandwidth_Bps=bw, matmul_efficiency=1.0,
                                      memory_efficiency=1.0))


def tied_embedding_sync_time(model: ModelSpec, par: ParallelSpec, hw: Hardware, grad_bytes: float) -> float:
    """All-reduce of the tied word embedding's gradient between the first and the last pipeline stage."""
    if par.pp <= 1 or not model.tie_embeddings:
        return 0.0
    link = hw.link_for_group(2, par.tp * par.cp * par.dp)  # the pipeline's link, as point-to-point uses
    return allreduce_time(model.vocab_size * model.hidden_size / par.tp * grad_bytes, 2, link)
