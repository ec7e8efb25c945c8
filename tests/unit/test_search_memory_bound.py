"""The stock candidates' memory bound (`search.bounds.partition_memory_reason`): never more than what a plan of the
method holds (sound), and, interleaved, every chunk's micro-batches alive at the schedule's peak counted together
(the Pareto vectors of `ScheduleFacts.live`), `block` with every layer's input and `mc-offload` with what it keeps on
the device (what that saves a search: benchmarks/search_bounds.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lynx.api import make_problem
from lynx.api import plan as plan_with
from lynx.cost.memory import held_bytes, layer_memories
from lynx.models import load_model
from lynx.problem import PlanOptions
from lynx.search.bounds import partition_memory_reason
from lynx.spec import ParallelSpec, load_hardware


@pytest.mark.parametrize("method", ["block", "mc-offload", "none", "full"])
def test_the_bound_never_exceeds_what_a_plan_holds_and_counts_every_chunk(method: str) -> None:
    par = ParallelSpec(tp=1, pp=2, dp=2, micro_batch_size=2, global_batch_size=32, seq_length=512)
    opts = PlanOptions(precision="megatron-bf16", vpp=2)
    prob = make_problem(load_model("llama-tiny"), load_hardware("h100-80g-nvlink"), par, opts)
    p = plan_with(prob, method, record=False)
    chunks = p.result.partition.chunks
    ctxs = p.problem.stage_contexts(p.result.partition)
    need = [c.static_bytes + held_bytes(layer_memories(p.problem.graphs_for(c), pol.layers), c)
            for c, pol in zip(ctxs, p.result.policies, strict=True)]
    # a budget each rank's statics and held activations just fit: the bound must not refuse the plan
    fits = replace(p.problem, options=replace(p.problem.options, budget_bytes=max(need) * (1 + 1e-9)))
    assert partition_memory_reason(fits, chunks, method) == ""
    # below what the chunks' inputs alone take at the peak (the old bound counted the fullest chunk only)
    low = max(c.static_bytes + c.peak_weighted(tuple(n * p.problem.graph.input_bytes for n in c.chunk_layers))
              for c in ctxs)
    tight = replace(p.problem, options=replace(p.problem.options, budget_bytes=low * 0.999))
    assert partition_memory_reason(tight, chunks, method) != ""
