"""Megatron's data-parallel overlaps: --overlap-grad-reduce and --overlap-param-gather.

Megatron-Core's DistributedDataParallel groups the gradients into buckets (`--ddp-bucket-size`, default
max(40M, 1M x DP) parameters, DP without CP: megatron/core/distributed/distributed_data_parallel.py,
`dp_group.size()`; the buckets are reduced over DP x CP, its `dp_cp_group`) and, with
--overlap-grad-reduce, launches each bucket's all-reduce (reduce-scatter with the distributed optimizer) as soon
as the last micro-batch's backward has produced its gradients (earlier micro-batches run under no_sync). With
--overlap-param-gather the distributed optimizer's all-gather of the updated parameters is issued bucket by
bucket and waited for in the forward pre-hook of the module that needs it, during the next iteration's first
forward. So:

* gradient reduction exposed = max(one bucket's collective, total - the last micro-batch's backward);
* parameter gather exposed = max(one bucket's all-gather, total - the first micro-batch's forward).

Without the switches both run after the last backward, as before. Contention of the concurrent collective
for SMs and memory bandwidth is left out (docs/costmodel.md).

An interleaved stage (VP model chunks per rank) reduces each chunk's gradients on their own
(`interleaved_exposed`): Megatron's interleaved schedule runs the final backwards chunk by chunk, pp micro-batches
of chunk v-1, then of chunk v-2, ..., then of chunk 0, and launches a chunk's reduction once its last micro-batch's
backward is done; with --delay-grad-reduce (Megatron's default) `rank` backward steps later, the same moment on
every rank of the pipeline (megatron/core/pipeline_parallel/schedules.py,
forward_backward_pipelining_with_interleaving, `grad_sync_microbatch_id`; training.py sets `grad_sync_func`).
Chunk 0's reduction is launched after the last backward, so at least it is exposed. The parameter all-gathers
are chained in chunk order, each bucket's dispatched when the forward pre-hook waits for the one before it
(megatron/core/optimizer/distrib_optimizer.py at f2e5db402c, `_finish_param_sync_helper`): chunk c's gathers run
during its own first forward, so each chunk is priced as one stage is, and the chunks' delays add up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lynx.cost.collectives import allreduce_time, gather_time
from lynx.cost.fp8_memory import gathered_param_bytes
from lynx.cost.static_memory import Recipe, stage_params
from lynx.spec import LinkSpec, ModelSpec, ParallelSpec

DEFAULT_BUCKET_PARAMS = 40_000_000
"""Megatron-Core's default bucket: max(40000000, 1000000 * data-parallel size) parameters
(megatron/core/distributed/distributed_data_parallel.py, `bucket_size` when --ddp-bucket-size is unset)."""


@dataclass(frozen=True, slots=True)
class DpSync:
    """One stage's data-parallel communication per iteration, split the way the overlaps see it."""

    grad_s: float
    """All-reduce (or reduce-scatter with the distributed optimizer) of the gradient buckets."""
    grad_bucket_s: float
    param_s: float
    """All-gather of the updated parameters (distributed optimizer only)."""
    param_bucket_s: float

    def exposed(self, overlap_grad: bool, overlap_param: bool, last_bwd_s: float, first_fwd_s: float) -> float:
        """Time the iteration sees: what each collective leaves beyond the compute it overlaps."""
        grad = min(self.grad_s, max(self.grad_bucket_s, self.grad_s - last_bwd_s)) if overlap_grad else self.grad_s
        param = min(self.param_s, max(self.param_bucket_s, self.param_s - first_fwd_s)) if overlap_param \
            else self.param_s
        return grad + param


def bucket_params(par: ParallelSpec, bucket_size: int | None) -> float:
    return float(bucket_size) if bucket_size is not None else float(max(DEFAULT_BUCKET_PARAMS, 1_000_000 * par.dp))


def dp_sync(model: ModelSpec, par: ParallelSpec, stage: int, num_layers: int, recipe: Recipe, link: LinkSpec,
            distributed_optimizer: bool, bucket_size: int | None = None) -> DpSync:
    """The stage's gradient reduction and parameter gather (totals as one ring collective each, the way
    `static_memory.dp_sync_time` has always priced them) and one bucket's share of each (what no overlap can
    hide: the last gradient bucket, the first parameter bucket)."""
    sp = stage_params(model, par, stage, num_layers)
    n = sp.total
    g = par.dp_cp  # gradients are reduced over DP x CP (Megatron-Core's data-parallel group with CP)
    if g <= 1 or n <= 0:
        return DpSync(0.0, 0.0, 0.0, 0.0)
    per = min(n, bucket_params(par, bucket_size))
    if distributed_optimizer:  # with --fp8-param-gather the layers' GEMM weights are gathered in FP8
        pb = gathered_param_bytes(model, par, n, sp.layers, recipe.param_bytes) / n
        return DpSync(gather_time(n * recipe.grad_bytes, g, link),
                      gather_time(per * recipe.grad_bytes, g, link),
                      gather_time(n * pb, g, link),
                      gather_time(per * pb, g, link))
    return DpSync(allreduce_time(n * recipe.grad_bytes, g, link),
                  allreduce_time(per * recipe.grad_bytes, g, link), 0.0, 0.0)


def dp_sync_chunks(model: ModelSpec, par: ParallelSpec, stage: int, chunk_layers: Sequence[int], recipe: Recipe,
                   link: LinkSpec, distributed_optimizer: bool, bucket_size: int | None = None) -> list[DpSync]:
    """`dp_sync` per model chunk of an interleaved stage: chunk c of rank `stage` is virtual stage c x pp + stage,
    so the word embedding is on chunk 0 of stage 0 and the head on the last chunk of the last stage."""
    g = par.dp_cp
    full = stage_params(model, par, stage, sum(chunk_layers))
    per_layer = full.layers / max(1, sum(chunk_layers))
    out = []
    last = len(chunk_layers) - 1
    for c, n_layers in enumerate(chunk_layers):
        n = n_layers * per_layer + (full.embedding if c == 0 else 0.0) \
            + (full.head + full.final_norm if c == last else 0.0)
        if g <= 1 or n <= 0:
            out.append(DpSync(0.0, 0.0, 0.0, 0.0))
            continue
        per = min(n, bucket_params(par, bucket_size))
        if distributed_optimizer:
            pb = gathered_param_bytes(model, par, n, n_layers * per_layer, recipe.param_bytes) / n
            out.append(DpSync(gather_time(n * recipe.grad_bytes, g, link),
                              gather_time(per * recipe.grad_bytes, g, link),
                              gather_time(n * pb, g, link),
                              gather_time(per * pb, g, link)))
        else:
            out.append(DpSync(allreduce_time(n * recipe.grad_bytes, g, link),
                              allreduce_time(per * recipe.grad_bytes, g, link), 0.0, 0.0))
    return out


def interleaved_exposed(chunks: Sequence[DpSync], overlap_grad: bool, overlap_param: bool, bwd_s: Sequence[float],
                        fwd_s: Sequence[float], pp: int, rank: int) -> float:
    """Exposed DP communication of an interleaved stage (module docstring): `chunks` per model chunk, `bwd_s` /
    `fwd_s` one micro-batch's backward / forward of each chunk. With one chunk it is `DpSync.exposed`."""
    if len(chunks) == 1:
        return chunks[0].exposed(overlap_grad, overlap_param, bwd_s[0], fwd_s[0])
    v = len(chunks)
    if overlap_grad:
        # chunk c's last backward ends pp x (chunks below it) before the rank's last backward (time 0)
        finish = float("-inf")
        for c in range(v - 1, -1, -1):
            launch = 0.0 if c == 0 else min(0.0, -pp * sum(bwd_s[:c]) + rank * bwd_s[c - 1])
            finish = max(finish, launch) + chunks[c].grad_s
        grad = max(0.0, finish)
    else:
        grad = sum(ch.grad_s for ch in chunks)
    if overlap_param:
        param = sum(min(ch.param_s, max(ch.param_bucket_s, ch.param_s - f)) for ch, f in zip(chunks, fwd_s,
                                                                                         strict=True))
    else:
        param = sum(ch.param_s for ch in chunks)
    return grad + param
