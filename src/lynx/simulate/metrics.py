"""Iteration metrics: the data-parallel gradient all-reduce and optimizer step after the pipeline, and the
throughput figures derived from the iteration time."""

from __future__ import annotations

from dataclasses import dataclass

from lynx.cost.dp_overlap import dp_sync, dp_sync_chunks, interleaved_exposed
from lynx.cost.fsdp import DpSharding
from lynx.cost.fsdp_time import fsdp_step_time, fsdp_tail
from lynx.cost.layer import model_flops_per_iteration
from lynx.cost.static_memory import Recipe, dp_sync_time, grad_buffer_time, optimizer_step_time
from lynx.decisions import StageContext
from lynx.spec import Hardware, ModelSpec, ParallelSpec
from lynx.stack import LayerKind, as_kinds


@dataclass(frozen=True, slots=True)
class DpOverlap:
    """Megatron's DP overlap switches and, per stage, the compute they hide behind (one micro-batch's
    backward for the gradient reduction, one forward for the parameter gather; `lynx.cost.dp_overlap`)."""

    grad_reduce: bool = False
    param_gather: bool = False
    bucket_size: int | None = None
    last_bwd_s: tuple[float, ...] = ()
    first_fwd_s: tuple[float, ...] = ()
    chunk_bwd_s: tuple[tuple[float, ...], ...] = ()
    """Per stage, one micro-batch's backward of each model chunk (interleaved stages; `lynx.cost.dp_overlap`)."""
    chunk_fwd_s: tuple[tuple[float, ...], ...] = ()
    check_for_nan: bool = True
    """Megatron's DDP switches for the passes over the gradient buffer (`static_memory.grad_buffer_passes`)."""
    average_in_collective: bool = False


def tail_time(model: ModelSpec, hw: Hardware, par: ParallelSpec, ctxs: tuple[StageContext, ...],
              ready: list[float], recipe: Recipe, distributed_optimizer: bool, tied_sync_s: float = 0.0,
              overlap: DpOverlap | None = None, sharding: DpSharding | None = None) -> float:
    """Time after the pipeline's last backward until every stage has reduced its gradients and stepped (and,
    with the distributed optimizer, gathered its parameters: before the next forward needs them), with
    Megatron's passes over the gradient buffer (`static_memory.grad_buffer_passes`).
    `tied_sync_s` > 0: the first and the last stage also all-reduce the tied embedding's gradient, once both
    have reduced their own (then step). `overlap`: what Megatron's DP overlaps hide of the reduction.
    `sharding`: FSDP (or a partial distributed optimizer): what it leaves after the pipeline and its optimizer
    step on the shard (`lynx.cost.fsdp_time`), in place of Megatron's DDP."""
    pipeline_time = max(ready)
    tail = 0.0
    synced: list[float] = []
    opts: list[float] = []
    ov = overlap or DpOverlap()
    for s, ctx in enumerate(ctxs):
        dp_link = hw.link_for_group(par.dp_cp, par.tp)  # DP x CP ranks, TP apart (CP then DP in rank order)
        if sharding is not None:  # FSDP overlaps what it leaves for once per iteration (a layer as the bucket)
            last_bwd = ov.last_bwd_s[s] if ov.last_bwd_s else 0.0
            first_fwd = ov.first_fwd_s[s] if ov.first_fwd_s else 0.0
            ar = fsdp_tail(model, hw, par, s, ctx.num_layers, recipe, sharding).exposed(True, True, last_bwd,
                                                                                       first_fwd)
            synced.append(ready[s] - pipeline_time + ar)
            opts.append(fsdp_step_time(model, hw, par, s, ctx.num_layers, recipe, sharding))
            continue
        if ov.grad_reduce or ov.param_gather:
            if len(ctx.chunk_layers) > 1 and ov.chunk_bwd_s:
                chunks = dp_sync_chunks(model, par, s, ctx.chunk_layers, recipe, dp_link, distributed_optimizer,
                                        ov.bucket_size)
                ar = interleaved_exposed(chunks, ov.grad_reduce, ov.param_gather, ov.chunk_bwd_s[s],
                                         ov.chunk_fwd_s[s], par.pp, s)
            else:
                sync = dp_sync(model, par, s, ctx.num_layers, recipe, dp_link, distributed_optimizer, ov.bucket_size)
                ar = sync.exposed(ov.grad_reduce, ov.param_gather, ov.last_bwd_s[s], ov.first_fwd_s[s])
        else:
            ar = dp_sync_time(model, par, s, ctx.num_layers, recipe, dp_link, distributed_optimizer, kinds(ctx))
        opt = optimizer_step_time(model, par, s, ctx.num_layers, recipe, hw.device, distributed_optimizer,
                                  kinds(ctx), hw.host(), hw.devices_per_node) \
            + grad_buffer_time(model, par, s, ctx.num_layers, recipe, hw.device, ov.check_for_nan,
                               ov.average_in_collective, kinds(ctx))
        synced.append(ready[s] - pipeline_time + ar)
        opts.append(opt)
    if tied_sync_s > 0 and len(synced) > 1:
        synced[0] = synced[-1] = max(synced[0], synced[-1]) + tied_sync_s
    for s in range(len(synced)):
        tail = max(tail, synced[s] + opts[s])
    return tail


def kinds(ctx: StageContext) -> tuple[LayerKind, ...] | None:
    """The stage's layer kinds for the static-memory functions (None: the model's one kind)."""
    return as_kinds(ctx.kinds)


def throughput(model: ModelSpec, hw: Hardware, par: ParallelSpec, iteration: float) -> tuple[float, float, float]:
    """(samples/s, model TFLOP/s per GPU, MFU) of one iteration. MFU is against the peak of the precision the GEMMs
    run at: an FP8 model's against the FP8 peak (NVIDIA's convention, dgxc-benchmarking's READMEs: 1979 TFLOP/s)."""
    samples = par.global_batch_size / iteration
    flops = model_flops_per_iteration(model, par)
    tflops = flops / iteration / par.world_size / 1e12
    peak = hw.device.fp8_peak_flops if model.fp8 is not None and hw.device.fp8_peak_flops else hw.device.peak_flops
    return samples, tflops, tflops * 1e12 / peak
