"""The registry of planning methods. A method maps a PlanProblem to a PlanResult (partition + one policy
per stage). New algorithms register here and nothing else changes: the CLI, the comparison table and the
simulator loop over the registry.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from lynx.errors import SpecError
from lynx.graph import LayerGraph
from lynx.memory import stage_peak_bytes
from lynx.partition.base import Partition
from lynx.partition.dp import dp_partition
from lynx.policy.base import RecomputePolicy, StageContext
from lynx.policy.rules import block_policy, full_policy, none_policy, selective_policy, uniform_policy
from lynx.problem import PlanProblem, PlanResult

MethodFn = Callable[[PlanProblem], PlanResult]
StagePolicyFn = Callable[[StageContext, LayerGraph], RecomputePolicy]


@dataclass(frozen=True, slots=True)
class Method:
    name: str
    description: str
    fn: MethodFn
    in_compare: bool = True
    """Part of `lynx plan --compare` (slow exact solvers opt out)."""


_REGISTRY: dict[str, Method] = {}
_PLUGINS: tuple[str, ...] = (
    # Modules that register more methods when imported. A module that is missing is skipped, so a
    # partial install still plans with the rule-based baselines.
    "lynx.policy.heu",
    "lynx.policy.opt",
    "lynx.policy.adapipe",
)
_loaded = False


def register(name: str, description: str, in_compare: bool = True) -> Callable[[MethodFn], MethodFn]:
    def deco(fn: MethodFn) -> MethodFn:
        _REGISTRY[name] = Method(name, description, fn, in_compare)
        return fn

    return deco


def _load_plugins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in _PLUGINS:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


def available_methods() -> list[str]:
    _load_plugins()
    return list(_REGISTRY)


def get_method(name: str) -> Method:
    _load_plugins()
    if name not in _REGISTRY:
        raise SpecError(f"unknown method {name!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def base_partition(problem: PlanProblem) -> Partition:
    """The user's explicit partition if given, else the paper's dp (parameter-balanced) partitioning."""
    lps = problem.options.layers_per_stage
    if lps is not None:
        return Partition(tuple(lps), method="explicit")
    return dp_partition(problem.model, problem.parallel)


def per_stage(problem: PlanProblem, name: str, fn: StagePolicyFn, partition: Partition | None = None) -> PlanResult:
    """Apply a per-stage policy function on a fixed partition (dp or the user's)."""
    t0 = time.perf_counter()
    part = partition or base_partition(problem)
    pols = tuple(fn(ctx, problem.graph) for ctx in problem.stage_contexts(part))
    return PlanResult(name, part, pols, search_time_s=time.perf_counter() - t0)


@register("none", "keep every activation (no recomputation)")
def _none(problem: PlanProblem) -> PlanResult:
    return per_stage(problem, "none", none_policy)


@register("full", "Megatron full: keep each layer's input, recompute the whole layer on demand")
def _full(problem: PlanProblem) -> PlanResult:
    return per_stage(problem, "full", full_policy)


@register("selective", "Megatron selective: recompute core attention on demand")
def _selective(problem: PlanProblem) -> PlanResult:
    return per_stage(problem, "selective", selective_policy)


@register("uniform", "Megatron --recompute-method uniform: chunks of --recompute-num-layers, input kept")
def _uniform(problem: PlanProblem) -> PlanResult:
    n = problem.options.recompute_num_layers or 1
    return per_stage(problem, "uniform", lambda c, g: uniform_policy(c, g, n))


@register("block", "Megatron --recompute-method block: first --recompute-num-layers layers per stage full")
def _block(problem: PlanProblem) -> PlanResult:
    n = problem.options.recompute_num_layers
    part = base_partition(problem)
    if n is None:  # the smallest N that fits every stage, by the closed-form peak
        ctxs = problem.stage_contexts(part)
        n = max(part.layers_per_stage)
        for cand in range(0, n + 1):
            pols = [block_policy(c, problem.graph, cand) for c in ctxs]
            peaks = [stage_peak_bytes(problem.graph, p.layers, c) for p, c in zip(pols, ctxs, strict=True)]
            if all(pk <= c.budget_bytes for pk, c in zip(peaks, ctxs, strict=True)):
                n = cand
                break
    k = n
    res = per_stage(problem, "block", lambda c, g: block_policy(c, g, k), part)
    return PlanResult(res.method, res.partition, res.policies, (f"--recompute-num-layers {k}",), res.search_time_s)


def _register_megatron_modules() -> None:
    """Megatron-Core --recompute-modules baselines: one method per module list users set today."""
    from lynx.policy.megatron_modules import modules_policy

    for mods in (("core_attn",), ("mlp",), ("layernorm",), ("core_attn", "mlp"), ("mlp", "layernorm"),
                 ("core_attn", "mlp", "layernorm")):
        name = "mc-" + "+".join(mods)

        def fn(problem: PlanProblem, mods: tuple[str, ...] = mods, name: str = name) -> PlanResult:
            return per_stage(problem, name, lambda c, g: modules_policy(c, g, mods))

        register(name, f"Megatron-Core --recompute-modules {' '.join(mods)} (on demand)")(fn)


_register_megatron_modules()
