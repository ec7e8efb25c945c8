"""A stack of layer kinds (docs/decisions/0221): DeepSeek-V3-like dense first layers under MoE layers, priced per
layer by kind in the simulator and the memory model, solved per kind by HEU, partitioned over unequal layers."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from lynx.api import make_problem, plan
from lynx.cost.edges import stage_edge_times
from lynx.cost.memory import stage_peak_bytes
from lynx.decisions import check_policy
from lynx.errors import SpecError
from lynx.methods.common import stage_policy
from lynx.models import model_from_dict
from lynx.partition.stack import stack_partition
from lynx.plan import Plan, plan_from_dict
from lynx.policy.heu import HeuOptions, solve_stage
from lynx.policy.rules import block_policy
from lynx.problem import PlanOptions
from lynx.spec import GiB, ParallelSpec, load_hardware

TINY_MOE = {"name": "tiny-moe", "family": "mcore", "num_layers": 6, "hidden_size": 256, "num_attention_heads": 8,
            "ffn_hidden_size": 1024, "vocab_size": 4096, "max_position_embeddings": 2048,
            "multi_latent_attention": True, "q_lora_rank": 96, "kv_lora_rank": 64, "qk_head_dim": 32,
            "qk_pos_emb_head_dim": 16, "v_head_dim": 32, "num_moe_experts": 8, "moe_router_topk": 2,
            "moe_ffn_hidden_size": 256, "moe_shared_expert_intermediate_size": 256,
            "moe_layer_pattern": [0, 0, 1, 1, 1, 1], "moe_grouped_gemm": True,
            "moe_token_dispatcher_type": "alltoall"}


def _problem(budget_gb: float | None = None, pp: int = 2):
    m = model_from_dict(TINY_MOE)
    par = ParallelSpec(tp=1, pp=pp, dp=4, ep=4, micro_batch_size=2, global_batch_size=32, seq_length=1024)
    return make_problem(m, load_hardware("h100-80g-nvlink"), par,
                        PlanOptions(budget_bytes=None if budget_gb is None else budget_gb * GiB))


def test_problem_carries_one_graph_per_kind() -> None:
    p = _problem()
    kinds = dict(p.kind_graphs)
    assert p.heterogeneous and set(kinds) == {"dense", "moe"}
    assert "dispatch_a2a" in kinds["moe"].names and "dispatch_a2a" not in kinds["dense"].names
    assert "gate_up" in kinds["dense"].names and "q_down" in kinds["dense"].names  # MLA in both kinds
    assert p.graph is kinds["moe"]  # the primary kind


def test_simulator_prices_each_layer_by_its_kind() -> None:
    p = _problem()
    res = plan(p, "none")
    kinds = dict(p.kind_graphs)
    ctxs = p.stage_contexts(res.result.partition)
    et = stage_edge_times(p.model, p.hardware, p.parallel, p.graph)
    edges = (et.embedding_fwd, et.head_fwd)
    for st, ctx, edge in zip(res.sim.stages, ctxs, edges, strict=True):
        want = sum(kinds[k].fwd_time() for k in ctx.kinds) + edge
        assert st.fwd_time_s == pytest.approx(want)
    # a stage of dense layers is cheaper than one of MoE layers of the same count (3 + 3 split)
    assert ctxs[0].kinds == ("dense", "dense", "moe") and ctxs[1].kinds == ("moe",) * 3


def test_heu_solves_a_mixed_stage_per_kind_within_budget() -> None:
    p = _problem()
    ctx = p.stage_context(0, 4, kinds=("dense", "dense", "moe", "moe"))
    graphs = p.graphs_for(ctx)
    keep_all = stage_peak_bytes(graphs, tuple(_keep(g) for g in graphs), ctx)
    tight = ctx.static_bytes + 0.6 * (keep_all - ctx.static_bytes)
    import dataclasses

    ctx2 = dataclasses.replace(ctx, budget_bytes=tight)
    pol = solve_stage(ctx2, graphs, HeuOptions())
    check_policy(graphs, pol, ctx2)
    assert stage_peak_bytes(graphs, pol.layers, ctx2) <= tight * (1 + 1e-6)
    assert pol.layers[0] == pol.layers[1] and pol.layers[2] == pol.layers[3]  # one policy per kind run
    dense_ops, moe_ops = set(graphs[0].names), set(graphs[2].names)
    assert set(pol.layers[2].keep) <= moe_ops and set(pol.layers[0].keep) <= dense_ops


def _keep(g):  # type: ignore[no-untyped-def]
    from lynx.decisions import LayerPolicy

    return LayerPolicy(g.needed())


def test_lynx_plans_the_stack_and_the_plan_file_round_trips() -> None:
    p = _problem(budget_gb=3.0)
    pl = plan(p, "lynx")
    assert not pl.sim.oom
    d = pl.to_dict()
    assert set(d["kind_graphs"]) == {"dense", "moe"}
    p2, r2 = plan_from_dict(d)
    again = Plan.evaluate(p2, r2, record=False)
    assert again.sim.iteration_time_s == pytest.approx(pl.sim.iteration_time_s)


def test_megatron_block_rule_keeps_its_position_semantics_across_kinds() -> None:
    p = _problem()
    ctx = p.stage_context(0, 4, kinds=("dense", "dense", "moe", "moe"))
    pol = stage_policy(lambda c, g: block_policy(c, g, 3), ctx, p.graphs_for(ctx))
    gs = p.graphs_for(ctx)
    assert [bool(lp.recompute) for lp in pol.layers] == [True, True, True, False]  # first 3 layers, any kind
    check_policy(gs, pol, ctx)


def test_methods_of_one_graph_refuse_a_stack() -> None:
    p = _problem()
    from lynx.methods import get_method

    with pytest.raises(SpecError, match="all of one kind"):
        get_method("adapipe").fn(p)


def test_stack_partition_is_the_exact_minmax() -> None:
    weights = [1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0, 3.0]

    def cost(s: int, first: int, n: int) -> float:
        return sum(weights[first:first + n]) + (0.5 if s == 0 else 0.0)

    res = stack_partition(len(weights), 3, cost)
    assert res.exact is not None
    best = math.inf
    for cuts in itertools.combinations(range(1, len(weights)), 2):
        b = (0, *cuts, len(weights))
        best = min(best, max(cost(s, b[s], b[s + 1] - b[s]) for s in range(3)))
    assert res.exact_cost == pytest.approx(best)
    assert res.exact.layers_per_stage[0] > res.exact.layers_per_stage[2]  # the light dense layers go together


def _bounded_against_plain(rng: random.Random, num_layers: int, stages: int) -> tuple[int, int]:
    """One random stack through `stack_partition` with and without `lower`: the same answer; the oracle calls of
    each."""
    plain = [rng.choice((1.0, 2.0, 3.0)) for _ in range(num_layers)]
    edge = [rng.choice((0.0, 0.5)) for _ in range(stages)]
    extra = {(s, i, n): rng.choice((0.0, 0.0, 1.0, 2.5, math.inf)) for s in range(stages)
             for i in range(num_layers) for n in range(1, num_layers + 1)}

    def lower(s: int, i: int, n: int) -> float:
        return sum(plain[i:i + n]) + edge[s]

    calls = [0, 0]

    def cost(s: int, i: int, n: int, which: int) -> float:
        calls[which] += 1
        return lower(s, i, n) + extra[s, i, n]

    plain_res = stack_partition(num_layers, stages, lambda s, i, n: cost(s, i, n, 0))
    bounded = stack_partition(num_layers, stages, lambda s, i, n: cost(s, i, n, 1), lower=lower)
    assert (bounded.exact, bounded.exact_cost) == (plain_res.exact, plain_res.exact_cost)
    assert calls[1] <= calls[0]
    return calls[1], calls[0]


def test_stack_partition_with_a_lower_bound_gives_the_same_split_asking_less() -> None:
    """With `lower` (the layers' plain times and the edge, a bound on the cost) the min-max asks the oracle fewer
    times and returns the same split and costs as without it, ties included (random stacks with infeasible stages,
    equal costs, and costs at their bound)."""
    rng = random.Random(7)
    asked_with = asked_without = 0
    for _ in range(200):
        num_layers = rng.randint(2, 14)
        stages = rng.randint(1, min(5, num_layers))
        w, wo = _bounded_against_plain(rng, num_layers, stages)
        asked_with, asked_without = asked_with + w, asked_without + wo
    assert asked_with < 0.8 * asked_without


def test_megatron_account_for_split_with_virtual_stages() -> None:
    """--account-for-embedding/loss-in-pipeline-split with VPP: the first virtual stage gives a layer's place to the
    embedding, the last to the loss (Qwen3-235B: 94 + 2 = 96 over PP 8 x VPP 4)."""
    import dataclasses

    from lynx.methods.common import megatron_partition

    m = model_from_dict({**TINY_MOE, "num_layers": 10, "moe_layer_pattern": [0] * 2 + [1] * 8})
    par = ParallelSpec(tp=1, pp=2, dp=4, ep=4, micro_batch_size=1, global_batch_size=32, seq_length=1024)
    p = make_problem(m, load_hardware("h100-80g-nvlink"), par, PlanOptions(vpp=3))
    p = dataclasses.replace(p, options=dataclasses.replace(p.options, account_for_embedding_in_pipeline_split=True,
                                                           account_for_loss_in_pipeline_split=True))
    part = megatron_partition(p)
    assert part.chunks == (1, 2, 2, 2, 2, 1) and part.layers_per_stage == (5, 5)


def test_recomputation_hides_in_the_token_all_to_alls() -> None:
    """The dispatch and combine all-to-alls are MLP-block windows (phase 2 forward, phase 3 backward): with memory
    tight, HEU recomputes inside them and the simulator counts the time as hidden."""
    from lynx.decisions import Phase
    from lynx.policy.heu_objective import window_caps

    full = _problem()
    moe = dict(full.kind_graphs)["moe"]
    caps = window_caps(moe, True)
    a2a = moe.op("dispatch_a2a").fwd_time + moe.op("combine_a2a").fwd_time
    assert a2a > 0 and caps[Phase.FWD_MLP] == pytest.approx(a2a)
    assert caps[Phase.BWD_MLP] == pytest.approx(moe.op("dispatch_a2a").bwd_time + moe.op("combine_a2a").bwd_time)
    none = plan(full, "none")
    peak = max(st.peak_memory_bytes for st in none.sim.stages)
    tight = _problem(budget_gb=0.93 * peak / GiB)
    pl = plan(tight, "lynx")
    assert not pl.sim.oom
    phases = {p for pol in pl.result.policies for lp in pol.layers for _, p in lp.recompute}
    assert phases & {Phase.FWD_MLP, Phase.BWD_MLP}
    assert sum(st.recompute_overlapped_s for st in pl.sim.stages) > 0
