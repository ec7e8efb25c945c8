"""Megatron's baselines as planning methods: none, full, selective, uniform(n), block(n) and the
--recompute-modules lists, each on the partition stock Megatron runs (`megatron_partition`: the even split,
or the user's explicit layout), not on lynx's partitioners."""

from __future__ import annotations

from lynx.cost.memory import layer_memories, stage_floor_bytes, stage_peak_bytes
from lynx.decisions import LayerPolicy, RecomputePolicy, StageContext
from lynx.graph import LayerGraph
from lynx.methods.common import MethodFn, StagePolicyFn, megatron_partition, per_stage, stage_policy
from lynx.policy.megatron_modules import modules_layer, modules_stage_policy
from lynx.policy.rules import (
    block_policy,
    full_layer,
    full_policy,
    keep_all,
    none_policy,
    selective_layer,
    selective_policy,
    titan_sac_layer,
    titan_sac_policy,
    uniform_policy,
)
from lynx.problem import PlanProblem, PlanResult


def plan_none(problem: PlanProblem) -> PlanResult:
    return per_stage(problem, "none", none_policy, megatron_partition(problem))


def plan_full(problem: PlanProblem) -> PlanResult:
    return per_stage(problem, "full", full_policy, megatron_partition(problem))


def plan_selective(problem: PlanProblem) -> PlanResult:
    return per_stage(problem, "selective", selective_policy, megatron_partition(problem))


def plan_titan_sac(problem: PlanProblem) -> PlanResult:
    """torchtitan's default activation checkpointing (per-op SelectiveAC) on every block, on the even split."""
    from lynx.errors import SpecError

    m = problem.model
    if m.family != "torchtitan-llama3":
        raise SpecError(f"--method titan-sac is torchtitan's per-op selective AC, priced on torchtitan's block; "
                        f"{m.name} is family {m.family!r}: plan a torchtitan-llama3-* model, or use selective / mc-*")
    if m.fp8 is not None:
        raise SpecError(f"--method titan-sac with {m.fp8.describe()}: torchtitan's policy counts aten mm ops, which "
                        "Float8Linear replaces; use none or full")
    return per_stage(problem, "titan-sac", titan_sac_policy, megatron_partition(problem))


def plan_uniform(problem: PlanProblem) -> PlanResult:
    n = problem.options.recompute_num_layers or 1
    return per_stage(problem, "uniform", lambda c, g: uniform_policy(c, g, n), megatron_partition(problem))


def _block_fn(n: int) -> StagePolicyFn:
    return lambda c, g: block_policy(c, g, n)


def _floor_fits(problem: PlanProblem, ctx: StageContext, pol: RecomputePolicy) -> bool:
    return stage_floor_bytes(layer_memories(problem.graphs_for(ctx), pol.layers), ctx) <= ctx.budget_bytes


def _fits(problem: PlanProblem, ctx: StageContext, pol: RecomputePolicy) -> bool:
    """`stage_peak_bytes <= budget`, deciding on the replay-free floor first where it is already over: the floor
    is the peak's own first terms, so it never exceeds the peak (`memory.stage_floor_bytes`), and the activation
    replay (most of the time of a deep stage) runs only for the values of N that might fit."""
    if not _floor_fits(problem, ctx, pol):
        return False
    return stage_peak_bytes(problem.graphs_for(ctx), pol.layers, ctx) <= ctx.budget_bytes


def _first_floor_fit(problem: PlanProblem, ctxs: tuple[StageContext, ...], hi: int) -> int:
    """The smallest N in [0, hi] whose floor fits every stage (hi when none below does), by bisection: block(N + 1)
    recomputes in full a layer that block(N) keeps whole, and a full layer retains only its input, so each stage's
    floor never grows with N. Every smaller N is over budget on its floor already; `plan_block` scans from here."""
    def ok(n: int) -> bool:
        return all(_floor_fits(problem, c, stage_policy(_block_fn(n), c, problem.graphs_for(c))) for c in ctxs)

    lo = 0
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def plan_block(problem: PlanProblem) -> PlanResult:
    """Megatron block(N): the first N layers of each stage (each model chunk when interleaved) recompute
    fully; N from the user, else the smallest that fits every stage by the closed-form peak."""
    n = problem.options.recompute_num_layers
    part = megatron_partition(problem)
    if n is None:
        ctxs = problem.stage_contexts(part)
        n = max(part.layers_per_stage)
        for cand in range(_first_floor_fit(problem, ctxs, n), n + 1):
            if all(_fits(problem, c, stage_policy(_block_fn(cand), c, problem.graphs_for(c))) for c in ctxs):
                n = cand
                break
    res = per_stage(problem, "block", _block_fn(n), part)
    return PlanResult(res.method, res.partition, res.policies, (f"--recompute-num-layers {n}",), res.search_time_s)


def fixed_layer_policy(method: str, graph: LayerGraph) -> LayerPolicy | None:
    """The one layer policy a Megatron method applies to every layer whatever the stage (none, full, selective and
    the dense --recompute-modules lists), None for the others (block and uniform depend on a layer's place; lynx's
    methods search). The configuration search prices a stock candidate's recomputation from it before planning
    (`search.tree.Frontier.method_bound`)."""
    if method == "none":
        return keep_all(graph)
    if method == "full":
        return full_layer(graph)
    if method == "selective":
        return selective_layer(graph)
    if method == "titan-sac":
        return titan_sac_layer(graph)
    mods = recompute_modules(method)
    if mods in MEGATRON_MODULE_LISTS:
        return modules_layer(graph, mods)
    return None


def recompute_modules(method: str) -> tuple[str, ...] | None:
    """The --recompute-modules list an `mc-*` baseline method sets (dense or MoE), None for any other method."""
    mods = tuple(method.removeprefix("mc-").split("+"))
    return mods if method.startswith("mc-") and mods in MEGATRON_MODULE_LISTS + MOE_MODULE_LISTS else None


MEGATRON_FLAG_METHODS = ("none", "full", "selective", "uniform", "block", "mc-offload")
"""The registry's methods that are Megatron-Core's own --recompute-granularity / --recompute-method flags, or its
stock fine-grained offloading; with the `mc-*` module lists (`recompute_modules`), its stock settings."""


def megatron_stock(method: str) -> bool:
    """A plan made by one of Megatron-Core's own settings (a stock configuration), not by lynx."""
    return method in MEGATRON_FLAG_METHODS or recompute_modules(method) is not None


MEGATRON_MODULE_LISTS: tuple[tuple[str, ...], ...] = (
    ("core_attn",), ("mlp",), ("layernorm",), ("core_attn", "mlp"), ("core_attn", "layernorm"), ("mlp", "layernorm"),
    ("core_attn", "mlp", "layernorm"),
)
"""Every non-empty combination of Megatron-Core's dense --recompute-modules, one baseline method each (a tuned
user picks the cheapest that fits; `core_attn layernorm` is what `lynx export megatron` hands out for the
README plan)."""


MOE_MODULE_LISTS: tuple[tuple[str, ...], ...] = (
    ("moe_act",), ("moe",), ("shared_experts",), ("layernorm", "moe_act"), ("layernorm", "moe"),
    ("mlp", "mla_up_proj"), ("mlp", "layernorm", "moe", "mla_up_proj"),
)
"""Megatron-Core's MoE --recompute-modules as baselines (MoE models only; `policy.megatron_modules`): each MoE
module alone, the Qwen3 recipes' layernorm + moe_act / moe, and the DeepSeek-V3 recipes' mla_up_proj + mlp
(NVIDIA's Megatron-MoE-ModelZoo best_practice scripts)."""


def plan_modules(mods: tuple[str, ...]) -> MethodFn:
    """Megatron-Core --recompute-modules MODS on every stage (recomputed on demand, as Megatron does)."""
    name = "mc-" + "+".join(mods)

    stage_fn = modules_stage_policy(mods)

    def fn(problem: PlanProblem) -> PlanResult:
        return per_stage(problem, name, stage_fn, megatron_partition(problem))

    return fn
