"""torchtitan's FSDP2 as torchtitan 0.3.0 runs it: the bytes one rank holds for parameters, gradients and
optimizer state (the static memory of the family ``torchtitan-llama3``; no torch here).

torchtitan wraps every model part in ``fully_shard`` whatever the data-parallel degrees
(torchtitan/models/llama3/parallelize.py: "Always run apply_fsdp_to_decoder", torchtitan/distributed/fsdp.py):
the token embedding, each transformer block, ``[norm, lm_head]`` together, then the root; mixed precision
``param_dtype`` = ``training.mixed_precision_param`` (bf16), ``reduce_dtype`` =
``training.mixed_precision_reduce`` (fp32); the model itself is built in fp32. What one rank holds:

* sharded, always: the fp32 parameter, its fp32 gradient, AdamW's ``exp_avg`` and ``exp_avg_sq`` -- 16 bytes
  per parameter over the shard degree N (``data_parallel_shard_degree``). Measured on CPU by
  tests/integration/test_titan_fsdp_bytes.py (2.00 + 2.00 bytes of parameter and gradient at N = 2).
* ``fsdp_reshard_after_forward`` "default" (`Reshard`): reshard after forward without a pipeline, keep the
  all-gathered 16-bit parameters with one (``get_fsdp_reshard_after_forward_policy``). ``[norm, lm_head]``
  is never resharded after forward unless "always" (it would be all-gathered again at once for backward).
* without resharding and with more than one pipeline micro-batch, torch's pipeline schedule turns gradient
  sync off until the last micro-batch (``PipelineStage.backward_maybe_with_nosync``) and FSDP accumulates the
  unsharded gradient in ``reduce_dtype`` (``FSDPParam.to_accumulated_grad_if_needed``): 4 bytes per parameter
  of the whole stage, unsharded.
* in flight at the activation peak (the start of backward; `TitanFsdp.in_flight_blocks`): the unit being
  computed ([norm, lm_head]) and the block FSDP2 prefetches for the next backward, and one unit's gradient:
  its 16-bit unsharded gradient and the ``reduce_dtype`` copy reduce-scattered.

Sharding pads each parameter's dim 0 to a multiple of N; the padding (under N rows per parameter) is left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lynx.spec import ModelSpec, ParallelSpec

BF16_BYTES = 2.0
FP32_BYTES = 4.0
ADAMW_STATE_BYTES = 8.0
"""AdamW's exp_avg and exp_avg_sq in the parameter's dtype (fp32): torchtitan's default optimizer."""
SHARDED_STATE_BYTES = FP32_BYTES + FP32_BYTES + ADAMW_STATE_BYTES
"""fp32 parameter + fp32 gradient + AdamW, all sharded: 16 bytes per parameter before sharding."""


class Reshard(str, Enum):
    """torchtitan's ``parallelism.fsdp_reshard_after_forward``."""

    DEFAULT = "default"
    """Reshard after forward without a pipeline; keep the parameters unsharded with one."""
    ALWAYS = "always"
    NEVER = "never"

    def after_forward(self, pp: int) -> bool:
        """torchtitan's ``get_fsdp_reshard_after_forward_policy`` for the blocks and the embedding."""
        return self is Reshard.ALWAYS or (self is Reshard.DEFAULT and pp == 1)


@dataclass(frozen=True, slots=True)
class TitanFsdp:
    """How torchtitan's FSDP runs on one rank."""

    shard: int
    """FSDP's shard degree (``data_parallel_shard_degree``); 1 when HSDP replicates everything."""
    pp: int = 1
    microbatches: int = 1
    """Pipeline micro-batches per step (with a pipeline, gradients accumulate unsharded over them)."""
    reshard: Reshard = Reshard.DEFAULT
    param_bytes: float = BF16_BYTES
    """``mixed_precision_param``: the all-gathered parameters forward and backward read."""
    reduce_bytes: float = FP32_BYTES
    """``mixed_precision_reduce``: the dtype gradients are reduce-scattered and accumulated in."""
    state_bytes: float = SHARDED_STATE_BYTES
    """Sharded bytes per parameter before sharding (fp32 parameter, gradient and AdamW state)."""
    in_flight_blocks: int = 2
    """Units all-gathered at once when resharding: the one computing, the block prefetched (FSDP2's default
    backward prefetch; a CPU run does not prefetch, tests/integration/test_titan_fsdp_bytes.py)."""

    @property
    def reshards(self) -> bool:
        return self.reshard.after_forward(self.pp)

    @property
    def accumulates_unsharded(self) -> bool:
        """Gradient sync off between pipeline micro-batches (no reshard after forward, a pipeline)."""
        return self.pp > 1 and self.microbatches > 1 and not self.reshards


@dataclass(frozen=True, slots=True)
class FsdpStatic:
    """Bytes one rank holds for one stage's parameters under torchtitan's FSDP, by kind."""

    sharded: float
    """fp32 parameter, gradient and optimizer shards."""
    unsharded_params: float
    """All-gathered 16-bit parameters kept through forward and backward (a stage's blocks with a pipeline,
    ``[norm, lm_head]`` without resharding it)."""
    accumulated_grads: float
    """Unsharded gradients accumulated in reduce dtype between pipeline micro-batches."""
    in_flight: float
    """Blocks unsharded for their forward / backward and one block's gradient on its way to reduce-scatter."""

    @property
    def total(self) -> float:
        return self.sharded + self.unsharded_params + self.accumulated_grads + self.in_flight


def fsdp_static(model: ModelSpec, par: ParallelSpec, stage: int, num_layers: int, fsdp: TitanFsdp) -> FsdpStatic:
    """One stage's bytes on one rank at its activation peak, the start of backward (parameters counted per TP
    rank, `lynx.cost.static_memory.stage_params`)."""
    from lynx.cost.static_memory import stage_params
    from lynx.families import get_family

    sp = stage_params(model, par, stage, num_layers)
    block = get_family(model.family).layer_params(model, par.tp)
    head = sp.head + sp.final_norm  # [norm, lm_head]: one FSDP unit (the last stage)
    unit = max(head, block)  # the unit whose gradient backward is producing
    sharded = sp.total * fsdp.state_bytes / fsdp.shard
    pb, rb = fsdp.param_bytes, fsdp.reduce_bytes
    if fsdp.reshards:
        # [norm, lm_head] stays all-gathered from its forward to its backward (all-gathered again for it under
        # "always"); the last block is prefetched for the next backward; one unit's gradient in bf16 and its
        # reduce_dtype copy for the reduce-scatter
        held = head * pb if fsdp.reshard is not Reshard.ALWAYS else 0.0
        again = 0.0 if held else head * pb
        return FsdpStatic(sharded, held, 0.0, again + min(fsdp.in_flight_blocks - 1, num_layers) * block * pb
                          + unit * (pb + rb))
    held = sp.total * pb
    if fsdp.accumulates_unsharded:  # the unit's bf16 gradient before it is added to the fp32 accumulator
        return FsdpStatic(sharded, held, sp.total * rb, unit * pb)
    return FsdpStatic(sharded, held, 0.0, unit * (pb + rb))


def titan_setting(par: ParallelSpec, distributed_optimizer: bool, bytes_per_param: float | None = None,
                  precision: str = "paper") -> TitanFsdp:
    """The FSDP `lynx export torchtitan` writes for a plan: shard over DP when the plan shards optimizer state
    (``--distributed-optimizer``), else HSDP that replicates over DP (shard 1); torchtitan's default reshard
    policy; ``--bytes-per-param`` overrides the sharded bytes per parameter (16: fp32 parameter, gradient,
    AdamW); ``--precision fp32`` computes with fp32 parameters (``mixed_precision_param float32``), the 16-bit
    recipes with bf16."""
    shard = par.dp_cp if distributed_optimizer and par.dp_cp > 1 else 1
    return TitanFsdp(shard=shard, pp=par.pp, microbatches=par.num_microbatches,
                     param_bytes=FP32_BYTES if precision == "fp32" else BF16_BYTES,
                     state_bytes=SHARDED_STATE_BYTES if bytes_per_param is None else bytes_per_param)


def titan_static_bytes(model: ModelSpec, par: ParallelSpec, stage: int, num_layers: int,
                       bytes_per_param: float | None, precision: str, distributed_optimizer: bool) -> float:
    """One rank's static bytes for a family whose `static_memory` is torchtitan's FSDP (`cost.memory.static_bytes`)."""
    fsdp = titan_setting(par, distributed_optimizer, bytes_per_param, precision)
    return fsdp_static(model, par, stage, num_layers, fsdp).total


__all__ = ["FsdpStatic", "Reshard", "TitanFsdp", "fsdp_static", "titan_setting", "titan_static_bytes"]
