"""A planning problem: model, hardware, layout, the layer graph, and options. Every method plans one."""

from __future__ import annotations

from dataclasses import dataclass, field

from lynx.graph import LayerGraph
from lynx.memory import (
    DEFAULT_BYTES_PER_PARAM,
    extra_retained_bytes,
    extra_transient_bytes,
    grad_workspace_bytes,
    static_bytes,
)
from lynx.partition.base import Partition
from lynx.policy.base import RecomputePolicy, StageContext
from lynx.spec import Hardware, ModelSpec, ParallelSpec
from lynx.validate import rng


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """Knobs that every method sees. Method-specific options live with the method."""

    bytes_per_param: float = field(default=DEFAULT_BYTES_PER_PARAM, metadata=rng(gt=0))
    """Static bytes per parameter (16: fp16 params + grads + fp32 Adam states; 18 with fp32 grads)."""
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


@dataclass(frozen=True, slots=True)
class PlanProblem:
    model: ModelSpec
    hardware: Hardware
    parallel: ParallelSpec
    graph: LayerGraph
    options: PlanOptions = field(default_factory=PlanOptions)

    @property
    def budget_bytes(self) -> float:
        b = self.options.budget_bytes
        return self.hardware.device.usable_bytes if b is None else b

    def stage_context(self, stage: int, num_layers: int) -> StageContext:
        par = self.parallel
        m = par.num_microbatches
        return StageContext(
            stage=stage,
            num_stages=par.pp,
            num_layers=num_layers,
            in_flight=min(par.pp - stage, m),
            num_microbatches=m,
            budget_bytes=self.budget_bytes,
            static_bytes=static_bytes(self.model, par, stage, num_layers, self.options.bytes_per_param),
            extra_retained_bytes=extra_retained_bytes(self.model, par, stage),
            extra_transient_bytes=extra_transient_bytes(self.model, par, stage),
            grad_workspace_bytes=grad_workspace_bytes(self.graph),
            subtract_wgrad=self.options.subtract_wgrad,
        )

    def stage_contexts(self, partition: Partition) -> tuple[StageContext, ...]:
        return tuple(self.stage_context(s, n) for s, n in enumerate(partition.layers_per_stage))


@dataclass(frozen=True, slots=True)
class PlanResult:
    """What a planning method returns: a partition and one policy per stage."""

    method: str
    partition: Partition
    policies: tuple[RecomputePolicy, ...]
    notes: tuple[str, ...] = ()
    search_time_s: float = 0.0
