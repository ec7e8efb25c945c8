"""The time of fully sharded data parallelism: per-layer parameter all-gathers and gradient reduce-scatters
overlapped with the layers' compute, and what is left for after the last backward.

How the frameworks run it (torch FSDP2 as torchtitan 0.3.0 configures it, torchtitan/distributed/fsdp.py;
Megatron-FSDP, megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py in megatron-core 0.16.1):

* Forward: each layer's parameters are all-gathered (in ``param_bytes``) before its forward; the next layer's
  gather is issued when a layer starts (``set_modules_to_forward_prefetch``, one ahead), so a layer's forward
  hides the next one's gather: exposed ``max(0, gather - forward)`` per layer, plus the first unit's gather,
  which nothing hides (the embedding on the first stage).
* Backward: resharded layers are gathered again, one ahead (``set_modules_to_backward_prefetch``); each
  layer's gradient is reduce-scattered (in ``reduce_dtype``: fp32) once its backward is done. While layer l's
  backward runs, the communication stream carries layer l+1's reduce-scatter and layer l-1's gather, so a
  backward step lasts ``max(gather + reduce, backward compute)``; the last unit's reduce-scatter is waited for
  at the end of the backward. torchtitan's trainer reduces every micro-batch (it never turns gradient sync off
  without a pipeline); with a pipeline and no reshard, torch's pipeline schedule accumulates unsharded
  gradients and reduces at the last micro-batch (`TitanFsdp.accumulates_unsharded`).
* Recomputation: a layer's recomputation runs after its backward gather (FSDP2's pre-backward hook unshards
  before the checkpointed forward reruns; Megatron-FSDP's pre-forward hook sees PRE_BACKWARD and keeps the
  parameters for the backward), so it costs no gather of its own -- and it runs on the compute stream while
  the gather of the layer below and the reduce-scatter of the layer above are in flight: the backward
  step's idle time ``max(0, gather + reduce - backward)`` is a window for the layer's on-demand
  recomputation (`lynx.cost.pricing.fsdp_window`).
* HSDP: each layer's sharded gradient is also all-reduced over the replicas (FSDP2 does it right after the
  reduce-scatter); the replicas are the outer rank dimension, DP x CP / instances ranks x TP apart.

Collectives are rings over the slowest link the group spans (`lynx.cost.collectives`); contention between the
FSDP stream and the TP collectives is left out, as it is for Megatron's DP overlaps.
"""

from __future__ import annotations

from dataclasses import dataclass

from lynx.cost.collectives import allreduce_time, gather_time
from lynx.cost.dp_overlap import DpSync
from lynx.cost.fp8_memory import gathered_param_bytes
from lynx.cost.fsdp import DpMode, DpSharding, Sharding
from lynx.cost.static_memory import Recipe, optimizer_step_bytes, stage_params
from lynx.cost.titan_fsdp import FP32_BYTES
from lynx.decisions import FsdpCharge
from lynx.families import get_family
from lynx.spec import Hardware, LinkSpec, ModelSpec, ParallelSpec


@dataclass(frozen=True, slots=True)
class Groups:
    """The FSDP groups of one rank: the shard group and the replicas."""

    shard: int
    shard_link: LinkSpec
    replicas: int
    replica_link: LinkSpec


def groups(hw: Hardware, par: ParallelSpec, ds: DpSharding) -> Groups:
    g = ds.shard(par)
    # DP x CP ranks are TP apart (Megatron's and torchtitan's order: TP innermost); the shard dimension is the
    # inner one (torchtitan's mesh ["dp_replicate", "dp_shard", ...]; Megatron's intra-instance group)
    return Groups(g, hw.link_for_group(g, par.tp), ds.instances, hw.link_for_group(ds.instances, par.tp * g))


def reduce_bytes(recipe: Recipe, ds: DpSharding) -> float:
    """Bytes per gradient element in the reduction: FSDP2's ``reduce_dtype`` fp32 (torchtitan's
    ``mixed_precision_reduce``), Megatron's gradient buffer dtype otherwise (Megatron-FSDP's
    ``--megatron-fsdp-grad-comm-dtype`` / ``--megatron-fsdp-main-grads-dtype`` where given: `DpSharding.comm_bytes`)."""
    return FP32_BYTES if ds.mode is DpMode.TORCH_FSDP2 else ds.comm_bytes(recipe)


def strategy(ds: DpSharding) -> Sharding:
    """A DDP with partial distributed optimizer (instances > 1) shards what Megatron-FSDP's ``optim`` does."""
    return ds.effective_strategy if ds.fsdp else Sharding.OPTIM


def _reduce(nbytes: float, gr: Groups) -> float:
    """Reduce-scatter over the shard group, then all-reduce of the shard over the replicas."""
    return gather_time(nbytes, gr.shard, gr.shard_link) + allreduce_time(nbytes / gr.shard, gr.replicas,
                                                                          gr.replica_link)


def per_microbatch(par: ParallelSpec, ds: DpSharding) -> tuple[bool, bool, bool]:
    """(gather before each forward, gather again before each backward, reduce each micro-batch's gradients)."""
    s = strategy(ds)
    reshards = ds.reshards(par.pp)
    # with a pipeline and no reshard, torch's schedule keeps the gathered parameters over the micro-batches and
    # accumulates unsharded gradients (PipelineStage.backward_maybe_with_nosync; `TitanFsdp`)
    held = par.pp > 1 and par.num_microbatches > 1 and not reshards
    return s.params and not held, s.params and reshards, s.grads and not held


def fsdp_charge(model: ModelSpec, hw: Hardware, par: ParallelSpec, stage: int, recipe: Recipe,
                ds: DpSharding) -> FsdpCharge:
    """The per-micro-batch FSDP collectives of one layer on `stage` and the exposed start and end of each
    micro-batch (`lynx.cost.stage.charge_stage` charges them)."""
    gr = groups(hw, par, ds)
    fam = get_family(model.family)
    n_layer = fam.layer_params(model, par.tp)
    pb, rb = recipe.param_bytes, reduce_bytes(recipe, ds)
    g_fwd, g_bwd, red = per_microbatch(par, ds)
    gather = gather_time(gathered_param_bytes(model, par, n_layer, n_layer, pb), gr.shard, gr.shard_link)
    reduce = _reduce(n_layer * rb, gr)
    first = fam.embedding_params(model, par.tp) if stage == 0 else n_layer  # the unit that opens the forward
    return FsdpCharge(gather_fwd_s=gather if g_fwd else 0.0, gather_bwd_s=gather if g_bwd else 0.0,
                      reduce_s=reduce if red else 0.0,
                      start_s=gather_time(first * pb, gr.shard, gr.shard_link) if g_fwd else 0.0,
                      end_s=_reduce(first * rb, gr) if red else 0.0)


def fsdp_tail(model: ModelSpec, hw: Hardware, par: ParallelSpec, stage: int, num_layers: int, recipe: Recipe,
              ds: DpSharding) -> DpSync:
    """What is left for once per iteration, overlapped as FSDP overlaps it (`DpSync.exposed` with both overlaps
    on, a layer as the bucket): gradients reduced once (no sharded gradients, or accumulated unsharded over a
    pipeline's micro-batches) during the last backward, and parameters gathered once (held unsharded over the
    micro-batches, or replicated parameters after a sharded optimizer step) during the first forward."""
    gr = groups(hw, par, ds)
    sp = stage_params(model, par, stage, num_layers)
    n = sp.total
    if n <= 0 or par.dp_cp <= 1:
        return DpSync(0.0, 0.0, 0.0, 0.0)
    n_layer = min(n, get_family(model.family).layer_params(model, par.tp))
    s = strategy(ds)
    pb, rb = recipe.param_bytes, reduce_bytes(recipe, ds)
    g_fwd, _, red = per_microbatch(par, ds)
    grad = bucket = 0.0
    if not red:
        if s.optim:
            grad, bucket = _reduce(n * rb, gr), _reduce(n_layer * rb, gr)
        else:
            grad, bucket = (allreduce_time(n * rb, par.dp_cp, hw.link_for_group(par.dp_cp, par.tp)),
                            allreduce_time(n_layer * rb, par.dp_cp, hw.link_for_group(par.dp_cp, par.tp)))
    param = pbucket = 0.0
    if (s.params and not g_fwd) or (s.optim and not s.params):
        param = gather_time(gathered_param_bytes(model, par, n, sp.layers, pb), gr.shard, gr.shard_link)
        pbucket = gather_time(gathered_param_bytes(model, par, n_layer, n_layer, pb), gr.shard, gr.shard_link)
    return DpSync(grad, bucket, param, pbucket)


def fsdp_step_time(model: ModelSpec, hw: Hardware, par: ParallelSpec, stage: int, num_layers: int, recipe: Recipe,
                   ds: DpSharding) -> float:
    """The optimizer step over the rank's shard and one zeroing pass over its gradients, memory-bound at the
    device's streaming bandwidth (`static_memory.optimizer_step_time`'s rule on the sharded counts)."""
    n = stage_params(model, par, stage, num_layers).total
    s = strategy(ds)
    g = ds.shard(par)
    dev = hw.device
    bw = dev.memory_bandwidth_Bps * dev.memory_efficiency
    step = n / (g if s.optim else 1) * optimizer_step_bytes(ds.recipe(recipe))
    zero = n / (g if s.grads else 1) * (FP32_BYTES if ds.mode is DpMode.TORCH_FSDP2 else ds.recipe(recipe).grad_bytes)
    return (step + zero) / bw


__all__ = ["Groups", "fsdp_charge", "fsdp_step_time", "fsdp_tail", "groups", "per_microbatch", "reduce_bytes"]
