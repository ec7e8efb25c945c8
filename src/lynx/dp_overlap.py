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
"""

from __future__ import annotations

from dataclasses import dataclass

from lynx.costmodel import allreduce_time, gather_time
from lynx.spec import LinkSpec, ModelSpec, ParallelSpec
from lynx.static_memory import Recipe, stage_params

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
    n = stage_params(model, par, stage, num_layers).total
    g = par.dp_cp  # gradients are reduced over DP x CP (Megatron-Core's data-parallel group with CP)
    if g <= 1 or n <= 0:
        return DpSync(0.0, 0.0, 0.0, 0.0)
    per = min(n, bucket_params(par, bucket_size))
    if distributed_optimizer:
        return DpSync(gather_time(n * recipe.grad_bytes, g, link),
                      gather_time(per * recipe.grad_bytes, g, link),
                      gather_time(n * recipe.param_bytes, g, link),
                      gather_time(per * recipe.param_bytes, g, link))
    return DpSync(allreduce_time(n * recipe.grad_bytes, g, link),
                  allreduce_time(per * recipe.grad_bytes, g, link), 0.0, 0.0)
