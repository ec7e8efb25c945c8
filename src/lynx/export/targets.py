"""A plan's price on the framework it will run on (`lynx plan --gpus ... --target`), computed exactly as
`lynx export <target>` prices it, so the search's pick and the export of its plan file show the same figures:

- megatron: lynx's engine inside Megatron-Core (`lynx.integrations.megatron`) where it runs the plan
  (`export.megatron_engine.engine_price`, the export table's engine row), else Megatron-Core with the exported
  flags and per-rank plugin (`export.megatron.megatron_run`, the "megatron+plugin" row);
- torchtitan: torchtitan's eager kernels and FSDP with lynx's engine or the AC module (`price_on_torchtitan`'s
  "torchtitan" row); None when torchtitan has no block for the model (not a llama) or cannot run the layout;
- lynx: the plan as planned, on lynx's own runtime (the simulator's price of the plan itself).
"""

from __future__ import annotations

from dataclasses import dataclass

from lynx.errors import SpecError
from lynx.export.pricing import Figures, simulate_lynx
from lynx.fp8 import Fp8Engine
from lynx.plan import Plan
from lynx.problem import PlanProblem, PlanResult
from lynx.request import Target
from lynx.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class TargetPrice:
    figures: Figures
    runs_on: str
    """What the row needs, in the user's words (the search table's method column)."""
    plan: Plan | None = None
    """The plan these figures are of where it is not the one priced: the search's plan made again as the target runs
    it (`lynx.search.prices.engine_variant`); None: the plan given."""


def check_target(model: ModelSpec, target: Target, cp: int | None = None) -> None:
    """A target that cannot run the model at all, refused before the search (one line naming it)."""
    from lynx.export.torchtitan import TITAN

    if not model.norm_fusion:
        raise SpecError(f"--target {target.value}: model {model.name!r} prices an eager fp32 RMSNorm (norm_fusion "
                        "false), which no target runs (Megatron-Core, torchtitan 0.3.0 on CUDA and lynx train run a "
                        "fused norm); price that older code on its own layout (lynx plan without --gpus)")
    if model.kv_repeat:
        raise SpecError(f"--target {target.value}: model {model.name!r} prices torchtitan's 2024 attention (kv_repeat "
                        "true), which no target runs (torchtitan 0.3.0 runs a fused QKV, Megatron-Core and lynx train "
                        "the llama block); price that older code on its own layout (lynx plan without --gpus)")
    torchao = model.fp8 is not None and model.fp8.engine is Fp8Engine.TORCHAO
    if target is not Target.TORCHTITAN and (model.compiled or torchao):
        what = model.fp8.describe() if torchao and model.fp8 is not None else "torch.compile"
        raise SpecError(f"--target {target.value}: model {model.name!r} prices {what}, which torchtitan runs (its "
                        "AC module; lynx's own runtime and Megatron-Core do not); use --target torchtitan")
    if target is Target.TORCHTITAN and model.family not in ("llama", TITAN):
        raise SpecError(f"--target torchtitan: lynx prices torchtitan's Llama block only (families llama, {TITAN}); "
                        f"{model.name} is {model.family!r}: use --target megatron or lynx")
    if target is Target.TORCHTITAN and cp is not None and cp > 1:
        raise SpecError(f"--target torchtitan with --cp {cp}: lynx does not price torchtitan's context parallelism; "
                        "use --target megatron or lynx")


def target_price(problem: PlanProblem, result: PlanResult, target: Target, stock: bool = False) -> TargetPrice | None:
    """The price of the plan on `target` (None: the target cannot run it). `stock`: the plan is a stock
    configuration of the target's framework (Megatron-Core's flags alone run it under the lynx target; torchtitan's
    activation checkpointing, not lynx's engine, runs it under the torchtitan target)."""
    from lynx.export.source import source_from

    if target is Target.LYNX:
        return TargetPrice(simulate_lynx(problem, result), "Megatron-Core" if stock else "lynx runtime")
    src = source_from(problem, result)
    if target is Target.MEGATRON:
        from lynx.export.megatron import megatron_run
        from lynx.export.megatron_engine import engine_price

        if not stock:  # lynx's engine inside Megatron-Core runs the plan with its windows where it can
            in_mcore, _ = engine_price(problem, result)
            if in_mcore is not None:
                return TargetPrice(in_mcore, "Megatron-Core + lynx engine")
        fig, plugin = megatron_run(src)
        return TargetPrice(fig, "Megatron-Core + lynx plugin" if plugin else "Megatron-Core")
    from lynx.export.torchtitan import ORDER, engine_table, layer_entry, price_on_torchtitan

    if src.family not in ORDER:
        return None
    layers = [layer_entry(problem.graph, lp) for pol in src.policies for lp in pol.layers]
    # torchtitan's own AC runs a stock policy as planned (none, full, and titan-sac: its SelectiveAC, which saves
    # the SP reduce-scatters the AC module's aten-op names cannot); lynx's engine runs lynx's plans as planned
    engine = engine_table(src)[0] is not None
    figs = price_on_torchtitan(src, layers, stock or engine)
    if len(figs) < 2:
        return None
    return TargetPrice(figs[1], "torchtitan" if stock else
                       "torchtitan + lynx engine" if engine else "torchtitan (AC module)")
