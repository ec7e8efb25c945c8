"""Data-parallel sharding as a choice (`DpSharding`): Megatron's DDP (with or without the distributed optimizer),
Megatron-FSDP's four strategies, torch FSDP2 and HSDP, and the bytes one rank holds under each.

Megatron-LM's flags (megatron/core/distributed/distributed_data_parallel_config.py, megatron-core 0.16.1):
``--use-megatron-fsdp`` with ``--data-parallel-sharding-strategy no_shard|optim|optim_grads|optim_grads_params``
(`Sharding`, ZeRO stages 0-3), ``--use-torch-fsdp2`` (torch's ``fully_shard``, which always shards parameters,
gradients and optimizer state), and ``--num-distributed-optimizer-instances`` ("the factor by which the DP domain
is sharded": each instance shards over DP / instances, the instances replicate -- HSDP). torchtitan's
``data_parallel_shard_degree`` x ``data_parallel_replicate_degree`` is the same split (`DpSharding.instances` =
the replicate degree). The time of the collectives is `lynx.cost.fsdp_time`; this module is the type and the
static memory, generalizing `lynx.cost.titan_fsdp` (torchtitan's FSDP2) to every strategy.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Literal

from lynx.cost.static_memory import DTYPE_BYTES
from lynx.cost.titan_fsdp import FP32_BYTES, SHARDED_STATE_BYTES, Reshard, TitanFsdp, fsdp_static
from lynx.errors import SpecError
from lynx.validate import rng

if TYPE_CHECKING:
    from lynx.cost.static_memory import Recipe
    from lynx.spec import ModelSpec, ParallelSpec


class DpMode(str, Enum):
    """Which data-parallel wrapper runs the model."""

    DDP = "ddp"
    """Megatron-Core's DistributedDataParallel: replicated parameters and gradients; the optimizer state sharded
    only with ``--use-distributed-optimizer`` (`PlanOptions.distributed_optimizer`, ZeRO-1)."""
    MEGATRON_FSDP = "megatron-fsdp"
    """``--use-megatron-fsdp`` with a `Sharding` strategy."""
    TORCH_FSDP2 = "torch-fsdp2"
    """``--use-torch-fsdp2`` (Megatron) or torchtitan: torch's ``fully_shard`` (parameters, gradients, state)."""


FsdpDtype = Literal["fp32", "bf16", "fp16", "auto"]
"""Megatron-FSDP's ``--megatron-fsdp-{main-params,main-grads,grad-comm}-dtype`` choices (megatron/training/
arguments.py after megatron-core 0.16.1, e.g. d98e8a64)."""


class Sharding(str, Enum):
    """Megatron-FSDP's ``--data-parallel-sharding-strategy``: what is split over the shard group."""

    NO_SHARD = "no_shard"
    OPTIM = "optim"
    OPTIM_GRADS = "optim_grads"
    OPTIM_GRADS_PARAMS = "optim_grads_params"

    @property
    def optim(self) -> bool:
        return self is not Sharding.NO_SHARD

    @property
    def grads(self) -> bool:
        return self in (Sharding.OPTIM_GRADS, Sharding.OPTIM_GRADS_PARAMS)

    @property
    def params(self) -> bool:
        return self is Sharding.OPTIM_GRADS_PARAMS


@dataclass(frozen=True, slots=True)
class DpSharding:
    """How parameters, gradients and optimizer state are laid out over the data-parallel ranks (DP x CP)."""

    mode: DpMode = DpMode.DDP
    strategy: Sharding = Sharding.OPTIM_GRADS_PARAMS
    """Megatron-FSDP's strategy; torch FSDP2 is always ``optim_grads_params``; ignored under DDP."""
    instances: int = field(default=1, metadata=rng(gt=0))
    """``--num-distributed-optimizer-instances`` / torchtitan's ``data_parallel_replicate_degree``: replicas of
    the sharded state; each shards over DP x CP / instances."""
    reshard: Reshard = Reshard.DEFAULT
    """Whether a layer's gathered parameters are freed after its forward (torchtitan's
    ``fsdp_reshard_after_forward``; Megatron-FSDP always reshards: ``default``)."""
    prefetch: int = field(default=1, metadata=rng(ge=1))
    """Layers all-gathered ahead of the one computing (FSDP2's and Megatron-FSDP's default: one). It sets the
    gathered layers in flight (memory); the time model overlaps each collective with one layer's compute, which
    deeper prefetching does not shorten where the link is the bottleneck (`lynx.cost.fsdp_time`)."""
    main_params_dtype: FsdpDtype | None = None
    """Megatron-FSDP's ``--megatron-fsdp-main-params-dtype`` (its MixedPrecisionPolicy, after megatron-core
    0.16.1): the main weights' buffer; ``auto`` makes the compute weights the main weights (no separate copy).
    None: not given, the recipe's fp32 main weights (0.16.1's ``preserve_fp32_weights``)."""
    main_grads_dtype: FsdpDtype | None = None
    """``--megatron-fsdp-main-grads-dtype``: the main gradients' buffer; ``auto`` is the compute weights' dtype.
    None: not given, the recipe's gradient buffer (0.16.1: fp32 for bf16 runs unless --grad-reduce-in-bf16)."""
    grad_comm_dtype: FsdpDtype | None = None
    """``--megatron-fsdp-grad-comm-dtype``: the gradient reduce-scatter's dtype; ``auto`` (or not given) is the
    main gradients'."""

    @property
    def fsdp(self) -> bool:
        return self.mode is not DpMode.DDP

    @property
    def effective_strategy(self) -> Sharding:
        return Sharding.OPTIM_GRADS_PARAMS if self.mode is DpMode.TORCH_FSDP2 else self.strategy

    def shard(self, par: ParallelSpec) -> int:
        """The shard group's size: DP x CP over the instances."""
        return max(1, par.dp_cp // self.instances)

    def reshards(self, pp: int) -> bool:
        """Megatron-FSDP frees gathered parameters after each forward (its `_post_forward`); FSDP2 as torchtitan
        configures it (`Reshard.after_forward`)."""
        if self.mode is DpMode.MEGATRON_FSDP:
            return self.reshard is not Reshard.NEVER
        return self.reshard.after_forward(pp)

    def recipe(self, r: Recipe) -> Recipe:
        """The recipe's buffers as Megatron-FSDP's dtype flags set them (`r` unchanged without them)."""
        if self.mode is not DpMode.MEGATRON_FSDP or (self.main_params_dtype is None and self.main_grads_dtype is None):
            return r
        grad, master = r.grad_bytes, r.master_bytes
        if self.main_grads_dtype is not None:
            grad = r.param_bytes if self.main_grads_dtype == "auto" else DTYPE_BYTES[self.main_grads_dtype]
        if self.main_params_dtype is not None:
            master = 0.0 if self.main_params_dtype == "auto" else DTYPE_BYTES[self.main_params_dtype]
        return replace(r, name=f"{r.name}+megatron-fsdp-dtypes", grad_bytes=grad, master_bytes=master)

    def comm_bytes(self, r: Recipe) -> float:
        """Bytes per gradient element Megatron-FSDP reduce-scatters: ``--megatron-fsdp-grad-comm-dtype``, else the
        main gradients' (`recipe`)."""
        if self.mode is DpMode.MEGATRON_FSDP and self.grad_comm_dtype not in (None, "auto"):
            return DTYPE_BYTES[self.grad_comm_dtype]
        return self.recipe(r).grad_bytes

    def label(self) -> str:
        if not self.fsdp:
            return "DDP" + (f" x{self.instances}" if self.instances > 1 else "")
        what = "FSDP2" if self.mode is DpMode.TORCH_FSDP2 else f"M-FSDP {self.strategy.value}"
        return what + (f" HSDP x{self.instances}" if self.instances > 1 else "")


DDP = DpSharding()
FSDP2 = DpSharding(DpMode.TORCH_FSDP2)


def check_sharding(ds: DpSharding, par: ParallelSpec, distributed_optimizer: bool) -> None:
    """Refuse a sharding the frameworks refuse (one line naming the flag)."""
    if ds.mode is DpMode.TORCH_FSDP2 and ds.strategy is not Sharding.OPTIM_GRADS_PARAMS:
        raise SpecError(f"--use-torch-fsdp2 shards everything; --data-parallel-sharding-strategy "
                        f"{ds.strategy.value} is Megatron-FSDP's (--use-megatron-fsdp)")
    if par.dp_cp % ds.instances:
        raise SpecError(f"--num-distributed-optimizer-instances {ds.instances} does not divide DP x CP = "
                        f"{par.dp_cp}")
    if ds.instances > 1 and not (ds.fsdp or distributed_optimizer):
        raise SpecError(f"--num-distributed-optimizer-instances {ds.instances} needs --use-distributed-optimizer "
                        "or FSDP (it splits the sharded state into replicas)")


def titan_sharding(ds: DpSharding, par: ParallelSpec, distributed_optimizer: bool) -> DpSharding:
    """What torchtitan runs for a plan: torchtitan always wraps the model in FSDP2 (decision 0102). A plan that
    names no FSDP keeps decision 0102's reading: shard over DP with the distributed optimizer, else HSDP that
    replicates over DP (shard 1)."""
    if ds.mode is DpMode.TORCH_FSDP2:
        return ds
    if distributed_optimizer or ds.mode is DpMode.MEGATRON_FSDP:
        return DpSharding(DpMode.TORCH_FSDP2, instances=ds.instances)
    return DpSharding(DpMode.TORCH_FSDP2, instances=max(1, par.dp_cp))


def running_sharding(model: ModelSpec, ds: DpSharding, par: ParallelSpec,
                     distributed_optimizer: bool) -> DpSharding | None:
    """The sharding priced by this module and `lynx.cost.fsdp_time`, or None where Megatron's DDP runs as
    `lynx.cost.static_memory` and `lynx.cost.dp_overlap` price it: FSDP as given; torchtitan's FSDP2 for a
    family whose static memory is torchtitan's (`titan_sharding`); a partial distributed optimizer
    (instances > 1) as Megatron-FSDP's ``optim``, which shards the same state the same way."""
    from lynx.families import get_family

    if get_family(model.family).static_memory == "torchtitan-fsdp":
        return titan_sharding(ds, par, distributed_optimizer)
    if ds.fsdp:
        return ds
    if ds.instances > 1 and distributed_optimizer:
        return DpSharding(DpMode.MEGATRON_FSDP, Sharding.OPTIM, ds.instances)
    return None


def titan_of(ds: DpSharding, par: ParallelSpec, param_bytes: float, state_bytes: float) -> TitanFsdp:
    """The `TitanFsdp` the FSDP2 byte model runs on for a sharding of parameters."""
    return TitanFsdp(shard=ds.shard(par), pp=par.pp, microbatches=par.num_microbatches, reshard=ds.reshard,
                     param_bytes=param_bytes, reduce_bytes=FP32_BYTES, state_bytes=state_bytes,
                     in_flight_blocks=ds.prefetch + 1)


@dataclass(frozen=True, slots=True)
class ShardedStatic:
    """Bytes one rank holds for one stage's parameters, gradients and optimizer state under a sharding."""

    params: float
    grads: float
    optimizer: float
    in_flight: float
    """Gathered layers and one layer's unsharded gradient around the activation peak (FSDP of parameters)."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.in_flight


def sharded_static(model: ModelSpec, par: ParallelSpec, stage: int, num_layers: int, recipe: Recipe,
                   ds: DpSharding, bytes_per_param: float | None = None) -> ShardedStatic:
    """One stage's static bytes on one rank under FSDP (`ds.fsdp`).

    * torch FSDP2 keeps fp32 parameters, fp32 gradients and AdamW state sharded (16 bytes per parameter, or the
      recipe's total when `--bytes-per-param` overrides it) and gathers ``param_bytes`` copies: torchtitan's
      model (`lynx.cost.titan_fsdp.fsdp_static`).
    * Megatron-FSDP keeps the recipe's buffers (its ``preserve_fp32_weights``: 16-bit parameters, the main
      gradient, fp32 main weights and Adam) and shards the ones its strategy names over DP x CP / instances;
      with ``optim_grads_params`` its layers are gathered one ahead and freed after use, as FSDP2's are.
    """
    from lynx.cost.static_memory import stage_params

    g = ds.shard(par)
    s = ds.effective_strategy
    recipe = ds.recipe(recipe)
    if ds.mode is DpMode.TORCH_FSDP2:
        state = SHARDED_STATE_BYTES if bytes_per_param is None else bytes_per_param
        st = fsdp_static(model, par, stage, num_layers, titan_of(ds, par, recipe.param_bytes, state))
        return ShardedStatic(st.unsharded_params, st.accumulated_grads, st.sharded, st.in_flight)
    if s.params:
        st = fsdp_static(model, par, stage, num_layers, titan_of(ds, par, recipe.param_bytes, recipe.total))
        return ShardedStatic(st.unsharded_params, st.accumulated_grads, st.sharded, st.in_flight)
    n = stage_params(model, par, stage, num_layers).total
    grads = n * recipe.grad_bytes / (g if s.grads else 1)
    state = n * recipe.state_bytes / (g if s.optim else 1)
    in_flight = 0.0
    if s.grads:  # one layer's unsharded gradient before its reduce-scatter
        from lynx.families import get_family

        in_flight = get_family(model.family).layer_params(model, par.tp) * recipe.grad_bytes
    return ShardedStatic(n * recipe.param_bytes, grads, state, in_flight)


__all__ = ["DDP", "FSDP2", "DpMode", "DpSharding", "FsdpDtype", "ShardedStatic", "Sharding",
           "check_sharding", "running_sharding", "sharded_static", "titan_of", "titan_sharding"]
