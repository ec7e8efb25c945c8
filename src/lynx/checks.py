"""The checks a planning problem and a planning result must pass, shared by `lynx plan` (on its inputs)
and `lynx simulate` / `lynx train` (on a plan file), so a saved plan is validated exactly as a new one."""

from __future__ import annotations

from lynx.cost.fsdp import check_sharding
from lynx.decisions import check_policy
from lynx.errors import PlanFormatError, SpecError
from lynx.graph import LayerGraph
from lynx.models import validate_layout
from lynx.problem import PlanOptions, PlanProblem, PlanResult
from lynx.spec import Hardware, ModelSpec, ParallelSpec
from lynx.validate import check_instance


def check_inputs(model: ModelSpec, hardware: Hardware, parallel: ParallelSpec, opts: PlanOptions) -> None:
    """Layout against model and hardware, every option finite and in range, the explicit partition."""
    check_instance(opts, "options")
    validate_layout(model, hardware, parallel, opts.nodes)
    if opts.layers_per_stage is not None:
        lps, stages = opts.layers_per_stage, parallel.pp * opts.vpp
        if len(lps) != stages or sum(lps) != model.num_layers or min(lps) < 1:
            pp = parallel.pp
            what = f"{pp}" if opts.vpp == 1 else f"{stages} (PP {pp} x VPP {opts.vpp})"
            text = ("|".join(",".join(map(str, lps[r::pp])) for r in range(pp)) if opts.vpp > 1 and len(lps) == stages
                    else ",".join(map(str, lps)))  # as the user typed it (the interleaved form by stage)
            raise SpecError(f"--layers-per-stage {text}: needs {what} positive entries summing to {model.num_layers}")
    check_vpp(opts.vpp, model, parallel, int(opts.account_for_embedding_in_pipeline_split)
              + int(opts.account_for_loss_in_pipeline_split))
    check_overlaps(opts, parallel)
    check_sharding(opts.dp_sharding, parallel, opts.distributed_optimizer)
    if opts.dp_sharding.fsdp and model.is_moe:  # sharded static memory knows one layer kind (`cost.fsdp`)
        raise SpecError(f"{model.name}: FSDP (--use-torch-fsdp2 / --use-megatron-fsdp) with expert layers is not "
                        "priced yet (experts shard over expert-DP, which lynx's FSDP model does not split); use the "
                        "distributed optimizer (--distributed-optimizer)")
    check_optimizer_precision(opts, model, hardware)
    if opts.tp_comm_overlap and model.transformer_impl == "local" and parallel.tp > 1:
        raise SpecError("--tp-comm-overlap needs --transformer-impl transformer_engine (the userbuffers overlap is "
                        "TransformerEngine's; Megatron-Core's local modules have none)")


def check_optimizer_precision(opts: PlanOptions, model: ModelSpec, hardware: Hardware | None = None) -> None:
    """The gradient-buffer and optimizer dtypes are Megatron's bf16 recipe's (arguments.py reads them under --bf16);
    the optimizer CPU offload as Megatron-Core accepts it and lynx prices it (`cost.optimizer_offload`)."""
    o = opts.optimizer_precision
    if o.is_default:
        return
    flags = "--grad-reduce-in-bf16 / --main-grads-dtype / --use-precision-aware-optimizer"
    if o.cpu_offload is not None:
        flags = "--optimizer-cpu-offload"
    if opts.precision != "megatron-bf16":
        raise SpecError(f"{flags}: Megatron's bf16 recipe only (--precision megatron-bf16, --bf16), got --precision "
                        f"{opts.precision}")
    if model.family == "torchtitan-llama3":
        raise SpecError(f"{flags}: Megatron-Core's optimizer options; torchtitan's FSDP keeps fp32 state")
    if o.cpu_offload is None:
        return
    if not o.use_precision_aware_optimizer:  # megatron/training/arguments.py asserts it
        raise SpecError("--optimizer-cpu-offload needs --use-precision-aware-optimizer (Megatron: \"the hybrid device "
                        "optimizer reuses the code path of this flag\")")
    if opts.dp_sharding.fsdp or opts.dp_sharding.instances > 1:
        raise SpecError("--optimizer-cpu-offload with FSDP or --num-distributed-optimizer-instances is not priced; "
                        "use it with --distributed-optimizer or plain DDP")
    if opts.bytes_per_param is not None:
        raise SpecError("--optimizer-cpu-offload with --bytes-per-param: the override fixes the state's bytes on the "
                        "GPU; give one of them")
    if hardware is not None and hardware.host() is None:
        raise SpecError(f"--optimizer-cpu-offload: hardware {hardware.name!r} has no host link (give host_link in "
                        "its hardware file)")


def check_overlaps(opts: PlanOptions, par: ParallelSpec) -> None:
    """Megatron's own conditions on its overlap switches (megatron/training/arguments.py asserts them)."""
    if opts.tp_comm_overlap and par.tp > 1 and not par.sequence_parallel:
        raise SpecError("--tp-comm-overlap needs sequence parallelism (--sp), as in Megatron (\"Tensor parallel "
                        "communication/GEMM overlap can happen only when sequence parallelism is enabled\")")
    if opts.overlap_param_gather and not opts.distributed_optimizer:
        raise SpecError("--overlap-param-gather needs --distributed-optimizer (Megatron: \"--overlap-param-gather "
                        "only supported with distributed optimizer\")")


def check_vpp(vpp: int, model: ModelSpec, par: ParallelSpec, accounted: int = 0) -> None:
    """Interleaved 1F1B needs Megatron's conditions: pp > 1, a multiple of pp micro-batches, a layer per
    virtual stage (the schedule package states the micro-batch rule too; this names the options). `accounted`:
    the embedding and the loss counted as layers (``--account-for-embedding/loss-in-pipeline-split``), which may
    then fill the first and the last virtual stage alone."""
    if vpp < 1:
        raise SpecError(f"--vpp must be at least 1, got {vpp}")
    if vpp == 1:
        return
    if par.pp < 2:
        raise SpecError(f"--vpp {vpp} needs pipeline parallelism (--pp >= 2), got --pp {par.pp}")
    if par.num_microbatches % par.pp:
        raise SpecError(f"--vpp {vpp}: interleaved 1F1B needs the number of micro-batches ({par.num_microbatches}) "
                        f"to be a multiple of --pp {par.pp} (Megatron-Core's rule)")
    if model.num_layers + accounted < par.pp * vpp:
        extra = f" (+ {accounted} for the embedding/loss)" if accounted else ""
        raise SpecError(f"--vpp {vpp}: {model.num_layers} layers{extra} cannot fill {par.pp} x {vpp} virtual stages")


def check_graph_matches(graph: LayerGraph, model: ModelSpec, par: ParallelSpec) -> None:
    m = graph.meta
    want = {"hidden_size": model.hidden_size, "num_attention_heads": model.num_attention_heads,
            "seq_length": par.seq_length, "micro_batch_size": par.micro_batch_size, "tp": par.tp,
            "sequence_parallel": par.sequence_parallel, "family": model.family,
            "num_query_groups": model.num_query_groups, "cp": par.cp}
    bad = [f"{k} {getattr(m, k)} (layout: {v})" for k, v in want.items() if getattr(m, k) not in (v, 0)]
    if bad:
        shape = [k for k in ("hidden_size", "num_attention_heads", "num_query_groups", "family")
                 if getattr(m, k) not in (want[k], 0)]
        hint = ("; a profile measures one layer's shape: plan it with a model YAML of that shape (--model my.yaml, "
                "docs/profiling.md \"Planning from a profile\") or profile a layer of this model" if shape else
                "; profile again with this layout's --seq-len/--micro-batch/--tp/--sp, or plan with the profile's")
        raise SpecError("the profiled graph does not match the layout: " + ", ".join(bad) + hint)


def check_result(problem: PlanProblem, result: PlanResult, where: str = "plan") -> None:
    """A partition with one entry per stage summing to the model's layers, and one valid policy per stage."""
    lps = result.partition.layers_per_stage
    pp, layers = problem.parallel.pp, problem.model.num_layers
    if len(lps) != pp or sum(lps) != layers:
        raise PlanFormatError(f"{where}: partition {','.join(map(str, lps))} must have {pp} entries (PP) "
                              f"summing to {layers} layers")
    if len(result.policies) != pp:
        raise PlanFormatError(f"{where}: {len(result.policies)} stage policies for PP {pp}")
    check_offload_link(problem, result, where)
    for pol, ctx in zip(result.policies, problem.stage_contexts(result.partition), strict=True):
        try:
            check_policy(problem.graphs_for(ctx), pol, ctx)
        except PlanFormatError as e:
            raise PlanFormatError(f"{where}: {e}") from None


def check_offload_link(problem: PlanProblem, result: PlanResult, where: str = "plan") -> None:
    """A plan that offloads activations needs a host link to copy them over: read with hardware that has none,
    it is refused before any work, naming the offloaded ops and the missing link."""
    hw = problem.hardware
    if hw.host() is not None:
        return
    ops = sorted({n for pol in result.policies for lp in pol.layers for n in lp.offload},
                 key=problem.graph.index)
    if ops:
        shown = ", ".join(ops[:4]) + (f" and {len(ops) - 4} more" if len(ops) > 4 else "")
        raise PlanFormatError(f"{where}: offloads {shown} to host memory, but hardware {hw.name!r} "
                              f"({hw.device.name}) has no host link to copy them over; give host_link (d2h_Bps, "
                              "h2d_Bps, ...) as the plan's hardware.host_link, or plan without offloading")
