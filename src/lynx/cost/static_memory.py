"""Static memory per pipeline stage: parameters, gradients and optimizer state, by precision recipe.

A recipe says how many bytes each parameter costs in each buffer; the distributed optimizer shards the
fp32 state (main weights, main gradients where they are a separate copy, Adam's m and v) over the
data-parallel ranks, as Megatron-LM does. Every figure and its source: docs/concepts/memory.md, "Static memory".

Megatron-LM's published accounting (docs/source/api-guide/dist_optimizer.md, "bytes per parameter"):

    recipe                          non-distributed   distributed optimizer
    fp16 params, fp16 grads               20               4 + 16/d
    bf16 params, fp32 grads               18               6 + 12/d
    fp32 params, fp32 grads               16               8 +  8/d

The paper's 16 bytes (fp16 params and grads, fp32 master, momentum and variance) is ZeRO's K = 12 accounting
(Rajbhandari et al. 2020, sec. 3.1); ZeRO stage 1 shards the 12 bytes: 4 + 12/d.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal

from lynx.cost.collectives import allreduce_time, gather_time
from lynx.cost.experts import moe_layer_params
from lynx.cost.fp8_memory import fp8_static_delta, gathered_param_bytes
from lynx.cost.optimizer_offload import FP32_MASTER_BYTES, GPU_STATE_BYTES, CpuOffload, host_step_s
from lynx.errors import SpecError
from lynx.families import get_family
from lynx.spec import DeviceSpec, HostLink, LinkSpec, ModelSpec, ParallelSpec
from lynx.stack import LayerKind, primary_kind

PrecisionName = Literal["paper", "megatron-bf16", "megatron-fp16", "fp32"]


class Precision(str, Enum):
    """A named recipe (`--precision`)."""

    PAPER = "paper"
    """fp16 params + fp16 grads + fp32 master, momentum, variance: 2 + 2 + 12 = 16 B (ZeRO sec. 3.1)."""
    MEGATRON_BF16 = "megatron-bf16"
    """bf16 params, fp32 main grads, fp32 main params + Adam m, v: 2 + 4 + 12 = 18 B (Megatron)."""
    MEGATRON_FP16 = "megatron-fp16"
    """fp16 params and grads, fp32 main grads copy, fp32 main params + Adam: 2 + 2 + 4 + 12 = 20 B (Megatron)."""
    FP32 = "fp32"
    """fp32 params and grads, Adam m, v (the params are the main weights): 4 + 4 + 8 = 16 B (Megatron)."""


@dataclass(frozen=True, slots=True)
class Recipe:
    """Bytes per parameter in each buffer. `sharded` bytes are what the distributed optimizer splits over DP."""

    name: str
    param_bytes: float
    """The model's own parameters (the dtype forward and backward read)."""
    grad_bytes: float
    """The gradient buffer backward accumulates into (Megatron's main_grad for bf16: fp32)."""
    main_grad_bytes: float
    """A separate fp32 gradient copy the optimizer reads (Megatron's fp16 recipe only)."""
    master_bytes: float
    """fp32 main weights; 0 when the parameters are fp32 already."""
    optimizer_bytes: float
    """Adam's momentum and variance in fp32: 8."""
    cpu_offload: CpuOffload | None = None
    """Megatron-Core's optimizer CPU offload: that fraction of the main weights and moments (and of their step) on
    the host (`lynx.cost.optimizer_offload`); None: all on the GPU."""

    @property
    def state_bytes(self) -> float:
        """What the distributed optimizer shards over DP, on the GPU (less what the CPU offload holds on the host)."""
        kept = 1.0 - self.cpu_offload.fraction if self.cpu_offload is not None else 1.0
        return self.main_grad_bytes + kept * (self.master_bytes + self.optimizer_bytes)

    @property
    def step_only_bytes(self) -> float:
        """The part of `state_bytes` alive only from the optimizer step to the next iteration's ``zero_grad``: the
        fp16 recipe's fp32 main-gradient copy (Megatron's optimizers make it in `_copy_model_grads_to_main_grads`,
        ``main_param.grad = model_grad.float()``, and drop it with ``zero_grad(set_to_none=True)`` before the next
        forward). No activation is alive then: it counts against the step's peak, not the forward's and backward's.
        Megatron's formula (`bytes_per_param`) counts it throughout."""
        return self.main_grad_bytes

    @property
    def total(self) -> float:
        return self.param_bytes + self.grad_bytes + self.state_bytes

    def bytes_per_param(self, dp: int, distributed_optimizer: bool) -> float:
        """Megatron's formula: `param + grad + state / d` with the distributed optimizer, else the total."""
        return self.param_bytes + self.grad_bytes + self.state_bytes / (dp if distributed_optimizer else 1)


RECIPES: dict[Precision, Recipe] = {
    Precision.PAPER: Recipe("paper", 2.0, 2.0, 0.0, 4.0, 8.0),
    Precision.MEGATRON_BF16: Recipe("megatron-bf16", 2.0, 4.0, 0.0, 4.0, 8.0),
    Precision.MEGATRON_FP16: Recipe("megatron-fp16", 2.0, 2.0, 4.0, 4.0, 8.0),
    Precision.FP32: Recipe("fp32", 4.0, 4.0, 0.0, 0.0, 8.0),
}


DtypeName = Literal["fp32", "bf16", "fp16", "fp8"]
DTYPE_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
"""fp8 optimizer moments are TransformerEngine's FusedAdam uint8 states with a per-tensor scale (negligible)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerPrecision:
    """Megatron's gradient-buffer and optimizer-state dtypes, as its flags name them (megatron/training/arguments.py
    and megatron/core/optimizer/optimizer_config.py, core_r0.16): ``--grad-reduce-in-bf16``,
    ``--use-precision-aware-optimizer`` (TransformerEngine's FusedAdam) with ``--main-grads-dtype``,
    ``--main-params-dtype``, ``--exp-avg-dtype``, ``--exp-avg-sq-dtype`` and ``store_param_remainders``
    (on by default; off with ``--no-store-param-remainders``); and where the state lives: ``--optimizer-cpu-offload``
    with ``--optimizer-offload-fraction`` and ``--overlap-cpu-optimizer-d2h-h2d`` (`cpu_offload`,
    `lynx.cost.optimizer_offload`). The default is Megatron's: fp32 throughout, on the GPU."""

    grad_reduce_in_bf16: bool = False
    use_precision_aware_optimizer: bool = False
    main_grads_dtype: Literal["fp32", "bf16"] = "fp32"
    main_params_dtype: Literal["fp32", "fp16"] = "fp32"
    exp_avg_dtype: DtypeName = "fp32"
    exp_avg_sq_dtype: DtypeName = "fp32"
    store_param_remainders: bool = True
    cpu_offload: CpuOffload | None = None

    @property
    def is_default(self) -> bool:
        return self == OPTIMIZER_FP32

    def bf16_grad_buffer(self) -> bool:
        """Megatron accumulates and reduces gradients in bf16 with --grad-reduce-in-bf16, or when
        --main-grads-dtype is bf16 (arguments.py leaves accumulate_allreduce_grads_in_fp32 off then)."""
        return self.grad_reduce_in_bf16 or self.main_grads_dtype == "bf16"

    def apply(self, r: Recipe) -> Recipe:
        """The recipe with these dtypes: a bf16 gradient buffer (2 B, and the DP reduction moves 2 B a parameter);
        with the precision-aware optimizer, its moments at their dtypes and the main parameters at fp16, or as the
        16-bit remainders beside bf16 parameters (store_param_remainders)."""
        if self.is_default:
            return r
        grad = min(r.grad_bytes, 2.0) if self.bf16_grad_buffer() else r.grad_bytes
        master, moments = r.master_bytes, r.optimizer_bytes
        if self.cpu_offload is not None:  # HybridDeviceOptimizer's fp32 copies and moments, on either side
            return Recipe(f"{r.name}+cpu-offload", r.param_bytes, grad, r.main_grad_bytes, FP32_MASTER_BYTES,
                          GPU_STATE_BYTES - FP32_MASTER_BYTES, self.cpu_offload)
        if self.use_precision_aware_optimizer and master:
            moments = DTYPE_BYTES[self.exp_avg_dtype] + DTYPE_BYTES[self.exp_avg_sq_dtype]
            if self.main_params_dtype == "fp16" or (self.store_param_remainders and r.param_bytes == 2.0):
                master = 2.0
        return Recipe(f"{r.name}+optimizer-dtypes", r.param_bytes, grad, r.main_grad_bytes, master, moments)

    def describe(self) -> str:
        parts = ["bf16 gradient buffer"] if self.bf16_grad_buffer() else []
        if self.cpu_offload is not None:
            c = self.cpu_offload
            parts.append(f"optimizer CPU offload of {c.fraction:.0%}{' (copies overlapped)' if c.overlap else ''}")
        elif self.use_precision_aware_optimizer:
            parts.append(f"precision-aware optimizer (moments {self.exp_avg_dtype}/{self.exp_avg_sq_dtype}, main "
                         f"params {self.main_params_dtype}{', remainders' if self.store_param_remainders else ''})")
        return ", ".join(parts)


OPTIMIZER_FP32 = OptimizerPrecision()


def parse_precision(name: str) -> Precision:
    try:
        return Precision(name)
    except ValueError:
        raise SpecError(f"--precision {name!r}: expected one of {', '.join(p.value for p in Precision)}") from None


def recipe_for(precision: str | Precision, bytes_per_param: float | None = None,
               optimizer: OptimizerPrecision | None = None) -> Recipe:
    """The recipe (with `optimizer`'s dtypes), or with `bytes_per_param` (the old `--bytes-per-param`) an override
    of its total: the params and grads keep the recipe's dtypes and the optimizer state takes the rest."""
    base = RECIPES[parse_precision(precision) if isinstance(precision, str) else precision]
    if optimizer is not None:
        base = optimizer.apply(base)
    if bytes_per_param is None:
        return base
    state = bytes_per_param - base.param_bytes - base.grad_bytes
    if state < 0:
        raise SpecError(
            f"--bytes-per-param {bytes_per_param:g}: less than the {base.param_bytes + base.grad_bytes:g} bytes "
            f"the {base.name} recipe's parameters and gradients take"
        )
    return Recipe(f"{base.name}@{bytes_per_param:g}", base.param_bytes, base.grad_bytes, 0.0, 0.0, state)


# ---------------------------------------------------------------------------------------------------
# Parameters per stage
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StageParams:
    """Parameter counts on one device of one stage."""

    layers: float
    embedding: float
    """Word (vocab-parallel) + position embedding on the first stage."""
    head: float
    """The LM head's weight on the last stage: Megatron's copy of the tied word embedding when PP > 1
    (its gradient is all-reduced with the first stage's), or the untied output layer."""
    final_norm: float
    experts: float = 0.0
    """Routed experts of the stage's MoE layers on this rank (their E / EP experts, split over ETP): reduced and
    sharded over expert-DP, the rest over DP x CP (`lynx.cost.experts`)."""

    @property
    def total(self) -> float:
        return self.layers + self.embedding + self.head + self.final_norm + self.experts


def stage_params(model: ModelSpec, par: ParallelSpec, stage: int, num_layers: int,
                 kinds: tuple[LayerKind, ...] | None = None) -> StageParams:
    """`kinds`: the stage's layer kinds (`lynx.stack`); None: `num_layers` of the model's primary kind."""
    t = par.tp
    first, last = stage == 0, stage == par.pp - 1
    family = get_family(model.family)
    norm = family.final_norm_params(model) if last else 0.0
    layers, experts = num_layers * family.layer_params(model, t), 0.0
    if model.is_moe:
        layers, experts = moe_layer_params(model, par, kinds or (primary_kind(model),) * num_layers, last)
    return StageParams(
        layers=layers,
        embedding=family.embedding_params(model, t) if first else 0.0,
        head=family.head_params(model, t, par.pp) - norm if last else 0.0,
        final_norm=norm,
        experts=experts,
    )


@dataclass(frozen=True, slots=True)
class StaticBreakdown:
    """Static bytes of one stage on one device, by buffer."""

    params: StageParams
    recipe: Recipe
    distributed_optimizer: bool
    dp: int
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    """Main weights and Adam state, after sharding over DP (the fp16 recipe's main-gradient copy: `step_bytes`)."""
    step_bytes: float = 0.0
    """Alive only in the optimizer step (`Recipe.step_only_bytes`), after sharding over DP."""

    @property
    def total(self) -> float:
        """What forward and backward see: the step-only copy is not allocated then."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def stage_static(
    model: ModelSpec, par: ParallelSpec, stage: int, num_layers: int, recipe: Recipe,
    distributed_optimizer: bool = False, kinds: tuple[LayerKind, ...] | None = None,
) -> StaticBreakdown:
    """Parameters, gradients and optimizer state of one stage on one device (every buffer holds every
    local parameter, the head copy included; the distributed optimizer divides the state by DP)."""
    sp = stage_params(model, par, stage, num_layers, kinds)
    n = sp.total
    shard = par.dp_cp if distributed_optimizer else 1  # Megatron shards over DP x CP
    eshard = par.edp if distributed_optimizer else 1  # and expert state over expert-DP
    return StaticBreakdown(
        params=sp, recipe=recipe, distributed_optimizer=distributed_optimizer, dp=par.dp,
        param_bytes=n * recipe.param_bytes + fp8_static_delta(model, par, num_layers, recipe.param_bytes),
        grad_bytes=n * recipe.grad_bytes,
        optimizer_bytes=(n - sp.experts) * (recipe.state_bytes - recipe.step_only_bytes) / shard
        + sp.experts * (recipe.state_bytes - recipe.step_only_bytes) / eshard,
        step_bytes=(n - sp.experts) * recipe.step_only_bytes / shard + sp.experts * recipe.step_only_bytes / eshard,
    )


def dp_sync_time(
    model: ModelSpec, par: ParallelSpec, stage: int, num_layers: int, recipe: Recipe, link: LinkSpec,
    distributed_optimizer: bool = False, kinds: tuple[LayerKind, ...] | None = None,
) -> float:
    """Data-parallel gradient synchronisation of one stage after its last backward: a ring all-reduce of
    the gradient buffer (its dtype: Megatron reduces bf16 runs' gradients in fp32); with the distributed
    optimizer a reduce-scatter of the gradients and an all-gather of the updated parameters instead."""
    sp = stage_params(model, par, stage, num_layers, kinds)
    n, e = sp.total - sp.experts, sp.experts
    g = par.dp_cp  # the gradient group: DP x CP; expert gradients over expert-DP (on the same link: an assumption)
    if distributed_optimizer:  # FP8 parameters gather one byte each (`fp8_memory`; dense layers' share only)
        dense = gathered_param_bytes(model, par, n, sp.layers, recipe.param_bytes)
        return gather_time(n * recipe.grad_bytes, g, link) + gather_time(dense, g, link) \
            + gather_time(e * recipe.grad_bytes, par.edp, link) + gather_time(e * recipe.param_bytes, par.edp, link)
    return allreduce_time(n * recipe.grad_bytes, g, link) + allreduce_time(e * recipe.grad_bytes, par.edp, link)


def optimizer_step_bytes(recipe: Recipe) -> float:
    """HBM bytes one Adam step moves per parameter it updates (a fused multi-tensor Adam, memory-bound at
    about 12 FLOPs per parameter): the gradient read twice (Megatron's gradient-norm clipping, default
    --clip-grad 1.0, then the step), the fp32 main weight and both moments read and written, and the
    16-bit model copy written. The fp16 recipe also copies the gradient into its fp32 main gradient."""
    grad = recipe.main_grad_bytes or recipe.grad_bytes
    copy = recipe.grad_bytes + recipe.main_grad_bytes if recipe.main_grad_bytes else 0.0
    # fp32 parameters are the main weights, updated in place
    weights = 2 * recipe.master_bytes + recipe.param_bytes if recipe.master_bytes else 2 * recipe.param_bytes
    return copy + 2 * grad + weights + 2 * recipe.optimizer_bytes


def grad_buffer_passes(par: ParallelSpec, check_for_nan: bool = True, average_in_collective: bool = False) -> int:
    """Passes over the whole local gradient buffer Megatron-Core's DistributedDataParallel makes per iteration
    besides the collectives (megatron/core/distributed/param_and_grad_buffer.py at f2e5db402c): it zeroes the
    buffer (`reset`, `grad_data.zero_()`: a write), and before each bucket's collective takes its norm for the
    NaN check (`check_for_nan_in_grad`, on by default: a read) and, over more than one data-parallel rank,
    scales it by 1/DP (`grad_data *= gradient_scaling_factor`: a read and a write). Megatron's
    `--no-check-for-nan-in-loss-and-grad` drops the norm; `--ddp-average-in-collective` averages inside the
    collective (gradient_scaling_factor 1.0), which drops the scaling."""
    return 1 + (1 if check_for_nan else 0) + (2 if par.dp_cp > 1 and not average_in_collective else 0)


def grad_buffer_time(model: ModelSpec, par: ParallelSpec, stage: int, num_layers: int, recipe: Recipe,
                     device: DeviceSpec, check_for_nan: bool = True, average_in_collective: bool = False,
                     kinds: tuple[LayerKind, ...] | None = None) -> float:
    """`grad_buffer_passes` over the stage's local gradient buffer (every local parameter, unsharded), memory-
    bound at the device's streaming bandwidth; on the stage's compute stream, so on its critical path."""
    n = stage_params(model, par, stage, num_layers, kinds).total
    passes = grad_buffer_passes(par, check_for_nan, average_in_collective)
    return passes * n * recipe.grad_bytes / (device.memory_bandwidth_Bps * device.memory_efficiency)


def optimizer_step_time(model: ModelSpec, par: ParallelSpec, stage: int, num_layers: int, recipe: Recipe,
                        device: DeviceSpec, distributed_optimizer: bool = False,
                        kinds: tuple[LayerKind, ...] | None = None, host: HostLink | None = None,
                        devices_per_node: int = 1) -> float:
    """The optimizer step of one stage on one device: memory-bound over the parameters it updates (all local
    ones, or with the distributed optimizer its 1/DP shard), at the device's streaming bandwidth; with the
    recipe's CPU offload, that part stepped on the host over `host` (`optimizer_offload.host_step_s`)."""
    sp = stage_params(model, par, stage, num_layers, kinds)
    n = (sp.total - sp.experts) / (par.dp_cp if distributed_optimizer else 1) \
        + sp.experts / (par.edp if distributed_optimizer else 1)
    gpu = n * optimizer_step_bytes(recipe) / (device.memory_bandwidth_Bps * device.memory_efficiency)
    if recipe.cpu_offload is None:
        return gpu
    if host is None:
        raise SpecError("--optimizer-cpu-offload needs the hardware's host link (host_link in the hardware file)")
    return host_step_s(recipe.cpu_offload, n, recipe.param_bytes, gpu, host, devices_per_node)
