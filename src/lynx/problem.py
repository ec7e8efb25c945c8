"""A planning problem: model, hardware, layout, the layer graph, and options. Every method plans one."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from lynx.cost.fsdp import DDP, DpSharding, running_sharding
from lynx.cost.memory import (
    extra_retained_bytes,
    extra_transient_bytes,
    grad_workspace_bytes,
    mtp_bytes,
    static_bytes,
)
from lynx.cost.static_memory import OPTIMIZER_FP32, OptimizerPrecision, PrecisionName, Recipe, recipe_for
from lynx.decisions import FsdpCharge, RecomputePolicy, StageContext
from lynx.graph import Graphs, LayerGraph, stage_graphs
from lynx.partition.base import Partition
from lynx.schedule import Schedule, ScheduleFacts, derive_facts, make_schedule
from lynx.spec import Hardware, ModelSpec, ParallelSpec
from lynx.stack import LayerKind, as_kinds, layer_kinds, stage_kinds
from lynx.validate import rng


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanOptions:
    """Knobs that every method sees. Method-specific options live with the method."""

    bytes_per_param: float | None = field(default=None, metadata=rng(gt=0))
    """Override of the precision recipe's static bytes per parameter (the old --bytes-per-param)."""
    precision: PrecisionName = "paper"
    """Static-memory recipe (`lynx.cost.static_memory`): paper 16 B, bf16 18 B, fp16 20 B, fp32 16 B."""
    distributed_optimizer: bool = False
    """Shard fp32 main weights and optimizer state over DP (Megatron --use-distributed-optimizer)."""
    optimizer_precision: OptimizerPrecision = OPTIMIZER_FP32
    """The gradient buffer's and the optimizer state's dtypes (--grad-reduce-in-bf16, --use-precision-aware-optimizer
    and its dtypes; `lynx.cost.static_memory.OptimizerPrecision`): Megatron's fp32 by default."""
    budget_bytes: float | None = field(default=None, metadata=rng(gt=0))
    """Usable memory per device; None means the device's capacity minus its reserve."""
    subtract_wgrad: bool = True
    """Backward windows offer comm - wgrad only (Megatron overlaps the wgrad GEMM already)."""
    cooldown_overlap: bool = True
    """Let Lynx hide recomputation in cool-down stalls (paper sec. 4.2, second optimization)."""
    recompute_num_layers: int | None = None
    """Megatron's --recompute-num-layers for uniform and block. None: uniform uses 1; block uses the
    smallest N with which every stage fits its budget (what a user finds by trial runs)."""
    include_dp_allreduce: bool = True
    """Add the data-parallel gradient all-reduce and the optimizer step to the iteration."""
    include_edges: bool = True
    """Charge the first stage's embedding and the last stage's LM head and loss (off: layers only)."""
    time_limit_s: float = field(default=30.0, metadata=rng(gt=0))
    """Per solver call, for the MILP methods."""
    nodes: int | None = field(default=None, metadata=rng(gt=0))
    layers_per_stage: tuple[int, ...] | None = field(default=None, metadata=rng(gt=0))
    """A user's explicit partition (--layers-per-stage); methods that do not partition use it."""
    decoder_first_pipeline_num_layers: int | None = field(default=None, metadata=rng(gt=0))
    """Megatron's --decoder-first-pipeline-num-layers, for the stock Megatron baselines' partition only
    (`methods.common.megatron_partition`); lynx's own methods partition on their own."""
    decoder_last_pipeline_num_layers: int | None = field(default=None, metadata=rng(gt=0))
    """Megatron's --decoder-last-pipeline-num-layers (the baselines' partition, as above)."""
    account_for_embedding_in_pipeline_split: bool = False
    """Megatron's flag: the embedding counts as one more layer of the baselines' even split."""
    account_for_loss_in_pipeline_split: bool = False
    """Megatron's flag: the loss counts as one more layer of the baselines' even split."""
    vpp: int = 1
    """Model chunks per rank: 1 is 1F1B, more is Megatron's interleaved 1F1B (--vpp)."""
    overlap_grad_reduce: bool = False
    """Megatron's --overlap-grad-reduce: the DP gradient reduction runs in buckets during the last
    micro-batch's backward; only what outlasts it (at least the last bucket) is exposed (`dp_overlap`)."""
    overlap_param_gather: bool = False
    """Megatron's --overlap-param-gather (distributed optimizer): the parameter all-gather runs in buckets
    during the next iteration's first forward; only what outlasts it (at least the first bucket) is exposed."""
    tp_comm_overlap: bool = False
    """Megatron's --tp-comm-overlap (TransformerEngine userbuffers; needs sequence parallelism): the SP
    collectives are pipelined with their GEMMs and the windows shrink to what is left (`lynx.cost.tp_overlap`)."""
    ddp_bucket_size: int | None = field(default=None, metadata=rng(gt=0))
    """Megatron's --ddp-bucket-size in parameters; None: Megatron's default max(40M, 1M x DP)."""
    check_for_nan_in_grad: bool = True
    """Megatron's DDP NaN check (default on; off with --no-check-for-nan-in-loss-and-grad): a norm of every
    gradient bucket before its collective, one read of the gradient buffer (`static_memory.grad_buffer_passes`)."""
    ddp_average_in_collective: bool = False
    """Megatron's --ddp-average-in-collective: the collective averages, so the 1/DP scaling pass over the
    gradient buffer is not made."""
    dp_sharding: DpSharding = DDP
    """How data parallelism lays out parameters, gradients and optimizer state (`lynx.cost.fsdp`): Megatron's DDP
    (the default; `distributed_optimizer` shards the optimizer state), Megatron-FSDP's strategies, torch FSDP2,
    HSDP replicas (--use-megatron-fsdp, --data-parallel-sharding-strategy, --use-torch-fsdp2,
    --num-distributed-optimizer-instances)."""


@functools.lru_cache(maxsize=256)  # the configuration search visits a few hundred (PP, micro-batches, VPP)
def _facts(pp: int, num_microbatches: int, vpp: int) -> ScheduleFacts:
    return derive_facts(make_schedule(pp, num_microbatches, vpp))


CONTEXT_ENTRIES = 4096
"""(problem, partition, schedule) triples `PlanProblem.stage_contexts` keeps before it starts again."""
_CONTEXTS: dict[tuple[object, ...], tuple[object, object, tuple[StageContext, ...]]] = {}


@dataclass(frozen=True, slots=True)
class PlanProblem:
    model: ModelSpec
    hardware: Hardware
    parallel: ParallelSpec
    graph: LayerGraph
    """The layer graph of every layer; with `kind_graphs`, the graph of the model's primary kind."""
    options: PlanOptions = field(default_factory=PlanOptions)
    kind_graphs: tuple[tuple[LayerKind, LayerGraph], ...] = ()
    """One graph per layer kind where the model's layers are of several kinds (DeepSeek-V3's dense first layers,
    `--moe-layer-freq` patterns; `lynx.stack`, docs/decisions/0221); empty: `graph` prices every layer."""

    @property
    def heterogeneous(self) -> bool:
        return bool(self.kind_graphs)

    def kind_graph(self, kind: str) -> LayerGraph:
        for k, g in self.kind_graphs:
            if k == kind:
                return g
        return self.graph

    def graphs_for(self, ctx: StageContext) -> Graphs:
        """What prices the stage's layers: the one graph, or one per layer by its kind."""
        if not ctx.kinds:
            return self.graph
        return stage_graphs(self.kind_graphs, ctx.kinds)

    def range_graphs(self, first: int, count: int) -> Graphs:
        """What prices layers first .. first + count - 1 (a virtual stage of an export's layout)."""
        kinds = self.range_kinds(first, count)
        return stage_graphs(self.kind_graphs, kinds) if kinds else self.graph

    def range_kinds(self, first: int, count: int) -> tuple[str, ...]:
        """The kinds of layers first .. first + count - 1 when the model has several (else empty)."""
        return stage_kinds(self.model, first, count) if self.kind_graphs else ()

    @property
    def static_recipe(self) -> Recipe:
        """The precision recipe, with `bytes_per_param` as an override of its total."""
        return recipe_for(self.options.precision, self.options.bytes_per_param, self.options.optimizer_precision)

    @property
    def budget_bytes(self) -> float:
        b = self.options.budget_bytes
        return self.hardware.device.usable_bytes if b is None else b

    @property
    def schedule(self) -> Schedule:
        """The action list lynx plans for (1F1B, or interleaved 1F1B with options.vpp chunks per rank)."""
        return self.facts.schedule

    @property
    def facts(self) -> ScheduleFacts:
        return _facts(self.parallel.pp, self.parallel.num_microbatches, self.options.vpp)

    def stage_context(self, stage: int, num_layers: int, chunk_layers: tuple[int, ...] = (),
                      facts: ScheduleFacts | None = None, kinds: tuple[str, ...] = ()) -> StageContext:
        """The context of rank `stage` with `num_layers` layers (split over its chunks as `chunk_layers`
        when interleaved); micro-batches in flight, forward windows and cool-down from the schedule's facts
        (`facts`: a user's schedule; default the problem's own). `kinds`: the layers' kinds, bottom first, for a
        model of several kinds (`range_kinds`; required then)."""
        if self.kind_graphs and len(kinds) != num_layers:
            raise ValueError(f"stage {stage}: a model of several layer kinds needs the kinds of its {num_layers} "
                             f"layers (got {len(kinds)})")
        par = self.parallel
        f = facts or self.facts
        chunks = f.chunks[stage]
        if len(chunks) > 1 and len(chunk_layers) != len(chunks):
            raise ValueError(f"stage {stage}: {len(chunks)} chunks in the schedule, layers given for "
                             f"{len(chunk_layers)}")
        in_flight = tuple(c.in_flight for c in chunks)
        o = self.options
        static, step = (static_bytes(self.model, par, stage, num_layers, o.bytes_per_param, o.precision,
                                     o.distributed_optimizer, o.dp_sharding, as_kinds(kinds), o.optimizer_precision,
                                     step_only=only) for only in (False, True))
        if static + step > self.budget_bytes:  # the optimizer step alone does not fit: nothing does
            static, step = static + step, 0.0
        return StageContext(
            stage=stage,
            num_stages=par.pp,
            num_layers=num_layers,
            in_flight=max(in_flight),
            num_microbatches=par.num_microbatches,
            budget_bytes=self.budget_bytes,
            static_bytes=static,
            step_bytes=step,
            extra_retained_bytes=extra_retained_bytes(self.model, par, stage),
            extra_transient_bytes=extra_transient_bytes(self.model, par, stage)
            + mtp_bytes(self.model, par, stage, self.graph),
            grad_workspace_bytes=grad_workspace_bytes(stage_graphs(self.kind_graphs, kinds) if kinds
                                                      else self.graph),
            subtract_wgrad=self.options.subtract_wgrad,
            fwd_windows=all(c.has_fwd_windows for c in chunks),
            cooldown_microbatches=max(c.cooldown_count for c in chunks),
            chunk_layers=chunk_layers if len(chunks) > 1 else (),
            chunk_in_flight=in_flight if len(chunks) > 1 else (),
            live_vectors=f.live[stage] if len(chunks) > 1 else (),
            fsdp=self.fsdp_charge(stage),
            kinds=kinds,
        )

    @property
    def dp_sharding(self) -> DpSharding | None:
        """The sharding `lynx.cost.fsdp` prices (None: Megatron's DDP, `lynx.cost.dp_overlap`)."""
        o = self.options
        return running_sharding(self.model, o.dp_sharding, self.parallel, o.distributed_optimizer)

    def fsdp_charge(self, stage: int) -> FsdpCharge | None:
        """FSDP's per-layer collectives on `stage` (None without FSDP, or with the DP time left out)."""
        from lynx.cost.fsdp_time import fsdp_charge

        ds = self.dp_sharding
        if ds is None or not self.options.include_dp_allreduce or self.parallel.dp_cp <= 1:
            return None
        return fsdp_charge(self.model, self.hardware, self.parallel, stage, self.static_recipe, ds)

    def stage_contexts(self, partition: Partition, facts: ScheduleFacts | None = None) -> tuple[StageContext, ...]:
        """Every rank's context on `partition` (`stage_context`). A planning call asks this of one problem object
        and partition several times (the method, the search's memory check, the simulator): kept per (problem
        object, partition, facts object); the entry holds both objects, so their ids are not reused while cached,
        and the contexts are frozen."""
        f = facts if facts is not None else self.facts
        key = (id(self), partition.layers_per_stage, partition.chunks, id(f))
        hit = _CONTEXTS.get(key)
        if hit is not None and hit[0] is self and hit[1] is f:
            return hit[2]
        out = tuple(self.stage_context(s, n, partition.chunk_layers(s) if partition.chunks else (), f,
                                       self.partition_kinds(partition, s))
                    for s, n in enumerate(partition.layers_per_stage))
        if len(_CONTEXTS) >= CONTEXT_ENTRIES:
            _CONTEXTS.clear()
        _CONTEXTS[key] = (self, f, out)
        return out

    def partition_kinds(self, partition: Partition, stage: int) -> tuple[str, ...]:
        """The kinds of the layers `partition` puts on `stage` (empty for a model of one kind)."""
        if not self.kind_graphs:
            return ()
        kinds = layer_kinds(self.model)
        return tuple(kinds[i] for i in partition.stage_layer_indices(stage))




@dataclass(frozen=True, slots=True)
class PlanResult:
    """What a planning method returns: a partition and one policy per stage."""

    method: str
    partition: Partition
    policies: tuple[RecomputePolicy, ...]
    notes: tuple[str, ...] = ()
    search_time_s: float = 0.0
