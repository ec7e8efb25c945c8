"""The registry of planning methods. A method maps a PlanProblem to a PlanResult (partition + one policy
per stage). The registry imports every method directly: a new algorithm is one line here, and the CLI,
the comparison table and the simulator loop over it."""

from __future__ import annotations

from dataclasses import dataclass

from lynx.errors import SpecError
from lynx.methods.adapipe import plan_adapipe
from lynx.methods.common import MethodFn
from lynx.methods.heu import lynx, lynx_heu, lynx_mixed
from lynx.methods.offload import plan_lynx_offload, plan_mc_offload, plan_offload_all
from lynx.methods.opt import plan_checkmate, plan_lynx_opt
from lynx.methods.rules import (
    MEGATRON_MODULE_LISTS,
    MOE_MODULE_LISTS,
    plan_block,
    plan_full,
    plan_modules,
    plan_none,
    plan_selective,
    plan_titan_sac,
    plan_uniform,
)


@dataclass(frozen=True, slots=True)
class Method:
    name: str
    description: str
    fn: MethodFn
    in_compare: bool = True
    """Part of `lynx plan --compare` (slow exact solvers opt out)."""
    moe_only: bool = False
    """A baseline of MoE layers (Megatron's MoE recompute modules): compared only for models with experts (not
    `in_compare`, so dense comparisons and their tests are unchanged; `api.compare` adds them for MoE models)."""
    family: str = ""
    """A baseline of one family's framework (torchtitan's default AC): compared only for models of that family
    (not `in_compare`; `api.compare` adds it for them)."""


METHODS: tuple[Method, ...] = (
    Method("none", "keep every activation (no recomputation)", plan_none),
    Method("full", "Megatron full: keep each layer's input, recompute the whole layer on demand", plan_full),
    Method("selective", "Megatron selective: recompute core attention on demand", plan_selective),
    Method("titan-sac", "torchtitan's default per-op selective AC: every other weight GEMM's output, attention and "
           "SP reduce-scatters kept, the rest recomputed on demand (torchtitan-llama3 models)", plan_titan_sac,
           in_compare=False, family="torchtitan-llama3"),
    Method("uniform", "Megatron --recompute-method uniform: chunks of --recompute-num-layers, input kept",
           plan_uniform),
    Method("block", "Megatron --recompute-method block: first --recompute-num-layers layers per stage full",
           plan_block),
    Method("lynx-heu", "Lynx-HEU per stage on dp partitioning (the paper's breakdown: HEU alone)", lynx_heu),
    Method("lynx", "Lynx: HEU recomputation scheduling + recomputation-aware partitioning (paper sec. 4.2, 5)",
           lynx),
    Method("lynx-mixed", "lynx, then two layer policies (k layers each) on the bottleneck stages where that "
           "helps", lynx_mixed),
    Method("lynx-opt", "Lynx-OPT: phase-indexed MILP over the stage's op timeline, overlap in TP windows "
           "(slow: --time-limit per stage)", plan_lynx_opt, in_compare=False),
    Method("checkmate", "Checkmate MILP (Jain et al. 2020): optimal recomputation without overlap "
           "(slow: --time-limit per stage)", plan_checkmate, in_compare=False),
    Method("adapipe", "AdaPipe (ASPLOS'24): per-stage DP over sub-layer units + partitioning DP; "
           "recomputation on demand", plan_adapipe),
    Method("lynx-offload", "lynx with offloading as HEU's third choice per op (keep, recompute or copy to host "
           "memory behind compute; docs/offload.md)", plan_lynx_offload),
    Method("mc-offload", "Megatron-Core stock --fine-grained-activation-offloading of every dense module "
           "(fraction 1, no PP delta, no recomputation)", plan_mc_offload),
    Method("offload-all", "keep every activation and offload all of it to host memory", plan_offload_all),
    *(Method("mc-" + "+".join(mods), f"Megatron-Core --recompute-modules {' '.join(mods)} (on demand)",
             plan_modules(mods)) for mods in MEGATRON_MODULE_LISTS),
    *(Method("mc-" + "+".join(mods), f"Megatron-Core --recompute-modules {' '.join(mods)} (on demand; MoE models)",
             plan_modules(mods), in_compare=False, moe_only=True) for mods in MOE_MODULE_LISTS),
)
_BY_NAME = {m.name: m for m in METHODS}


def available_methods() -> list[str]:
    return [m.name for m in METHODS]


def get_method(name: str) -> Method:
    if name not in _BY_NAME:
        raise SpecError(f"unknown method {name!r}; known: {', '.join(_BY_NAME)}")
    return _BY_NAME[name]
