"""ZeRO stages and state offloading per pipeline stage, as Mist (EuroSys'25) names and runs them.

Megatron's distributed optimizer (`static_memory`, `--distributed-optimizer`) is ZeRO stage 1. Mist tunes, per
stage, which of the three model states are sharded over the stage's data-parallel ranks and what fraction of
each is offloaded to host memory (its configuration tuple: WeightsSharding, GradsSharding, OptSharding, then the
offload ratios W, G, O; github.com/Dazz993/Mist at d69e530a, README "Tune the small case"):

    ZeRO-1  optimizer state (fp32 main weights, Adam m and v; the fp16 recipe's fp32 main gradient) over DP
    ZeRO-2  and the gradients
    ZeRO-3  and the 16-bit weights, all-gathered for each micro-batch's forward and backward

This module prices what that changes against `static_memory`: the state bytes a stage keeps on the device and on
the host, and the per-iteration time the sharding and offloading add. It is used to price configurations other
systems chose (benchmarks/mist.py); lynx's own search does not enumerate these choices. Issue 33 will add fully
sharded data parallelism to the cost model itself; this module stays outside the simulator until then.

Time, per stage and iteration (docs/mist.md, "What lynx prices of Mist's configurations"):

* offloaded optimizer state is streamed through the host link for the step: the offloaded fraction of the
  (sharded) state copied in and out, both directions at once (PCIe is full duplex), after the stage's last
  backward; only what outlasts the stage's slack before the pipeline's last backward is exposed;
* ZeRO-2 reduce-scatters the gradients of every micro-batch (they cannot accumulate unsharded), ZeRO-3 also
  all-gathers the weights before each micro-batch's forward and backward; each hides behind the micro-batch's
  own compute (Mist's overlap-centric schedule) and only the excess is exposed, once per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from lynx.cost.collectives import gather_time
from lynx.cost.static_memory import Recipe, stage_params
from lynx.errors import SpecError
from lynx.spec import HostLink, LinkSpec, ModelSpec, ParallelSpec


class ZeroStage(IntEnum):
    """Which model states are sharded over the data-parallel ranks (Rajbhandari et al. 2020, sec. 5)."""

    NONE = 0
    OPTIMIZER = 1
    GRADIENTS = 2
    WEIGHTS = 3

    @staticmethod
    def of_flags(weights: int, grads: int, optimizer: int, where: str = "zero flags") -> ZeroStage:
        """Mist's three sharding flags as a ZeRO stage: each stage shards a superset of the one below, so the
        flags must be a suffix (optimizer, then grads, then weights); anything else is refused."""
        flags = (bool(weights), bool(grads), bool(optimizer))
        stages = {(False, False, False): ZeroStage.NONE, (False, False, True): ZeroStage.OPTIMIZER,
                  (False, True, True): ZeroStage.GRADIENTS, (True, True, True): ZeroStage.WEIGHTS}
        if flags not in stages:
            raise SpecError(f"{where}: sharding flags (weights {weights}, grads {grads}, optimizer {optimizer}) "
                            "are no ZeRO stage; valid: (0,0,0), (0,0,1), (0,1,1), (1,1,1)")
        return stages[flags]


@dataclass(frozen=True, slots=True)
class StateLayout:
    """One stage's ZeRO stage and offload fractions (each in [0, 1]) of its data-parallel group."""

    zero: ZeroStage
    offload_weights: float = 0.0
    offload_grads: float = 0.0
    offload_optimizer: float = 0.0

    def __post_init__(self) -> None:
        for f in ("offload_weights", "offload_grads", "offload_optimizer"):
            v = getattr(self, f)
            if not 0.0 <= v <= 1.0:
                raise SpecError(f"state layout: {f} {v} must lie in [0, 1]")


@dataclass(frozen=True, slots=True)
class StageState:
    """Bytes of one stage's model states on one device and on the host, by buffer."""

    weights: float
    grads: float
    optimizer: float
    host: float

    @property
    def device(self) -> float:
        return self.weights + self.grads + self.optimizer


def stage_state(model: ModelSpec, par: ParallelSpec, stage: int, num_layers: int, recipe: Recipe,
                layout: StateLayout) -> StageState:
    """Device and host bytes of the stage's weights, gradients and optimizer state under `layout`: each
    buffer divided by DP x CP when its ZeRO stage shards it, then less its offloaded fraction."""
    n = stage_params(model, par, stage, num_layers).total
    d = par.dp_cp
    w = n * recipe.param_bytes / (d if layout.zero >= ZeroStage.WEIGHTS else 1)
    g = n * recipe.grad_bytes / (d if layout.zero >= ZeroStage.GRADIENTS else 1)
    o = n * recipe.state_bytes / (d if layout.zero >= ZeroStage.OPTIMIZER else 1)
    host = w * layout.offload_weights + g * layout.offload_grads + o * layout.offload_optimizer
    return StageState(w * (1 - layout.offload_weights), g * (1 - layout.offload_grads),
                      o * (1 - layout.offload_optimizer), host)


def gathered_layer_bytes(model: ModelSpec, par: ParallelSpec, recipe: Recipe, layout: StateLayout,
                         prefetch_layers: int = 2) -> float:
    """ZeRO-3's transient: the full 16-bit weights of the layers gathered at once (the one computing and the
    one prefetched), beyond the stage's shard."""
    if layout.zero < ZeroStage.WEIGHTS:
        return 0.0
    from lynx.families import get_family

    per_layer = get_family(model.family).layer_params(model, par.tp) * recipe.param_bytes
    return prefetch_layers * per_layer * (1 - 1 / par.dp_cp)


def optimizer_offload_time(state: StageState, layout: StateLayout, host: HostLink, devices_per_node: int) -> float:
    """Host-link time of one step over the offloaded optimizer state: the offloaded bytes copied in and back
    out, the two directions concurrent (full duplex) at one GPU's share of its uplink."""
    if layout.offload_optimizer <= 0.0:
        return 0.0
    d2h, h2d, _ = host.per_gpu(devices_per_node)
    offloaded = state.optimizer / (1 - layout.offload_optimizer) * layout.offload_optimizer \
        if layout.offload_optimizer < 1.0 else state.host
    return max(offloaded / d2h, offloaded / h2d) if host.duplex else offloaded / d2h + offloaded / h2d


def sharding_comm_per_microbatch(model: ModelSpec, par: ParallelSpec, stage: int, num_layers: int,
                                 recipe: Recipe, layout: StateLayout, link: LinkSpec) -> tuple[float, float]:
    """(forward, backward) collective seconds per micro-batch that ZeRO-2/3 add on the stage's DP group."""
    if layout.zero < ZeroStage.GRADIENTS or par.dp_cp <= 1:
        return 0.0, 0.0
    n = stage_params(model, par, stage, num_layers).total
    rs = gather_time(n * recipe.grad_bytes, par.dp_cp, link)
    if layout.zero < ZeroStage.WEIGHTS:
        return 0.0, rs
    ag = gather_time(n * recipe.param_bytes, par.dp_cp, link)
    return ag, ag + rs


def exposed_sharding_time(comm: tuple[float, float], fwd_s: float, bwd_s: float, microbatches: int) -> float:
    """What the per-micro-batch collectives leave beyond the compute they overlap, over the iteration."""
    return microbatches * (max(0.0, comm[0] - fwd_s) + max(0.0, comm[1] - bwd_s))
