"""Megatron's baselines as Megatron runs them (issue 20): selective recomputation around flash attention
re-runs the kernel, and every stock baseline is priced on Megatron's own partition."""

from __future__ import annotations

import pytest

from lynx.api import compare, plan
from lynx.cost.memory import layer_memory
from lynx.cost.pricing import recompute_time
from lynx.decisions import LayerPolicy, Phase, RecomputePolicy, check_policy, validate_layer_policy
from lynx.errors import SpecError
from lynx.policy.megatron_modules import modules_layer
from lynx.policy.rules import keep_all, selective_layer
from tests.conftest import problem_for

BASELINES = ("none", "full", "selective", "uniform", "block", "mc-core_attn", "mc-mlp", "mc-core_attn+layernorm",
             "mc-core_attn+mlp+layernorm")


def _llama8b(**opts: object):  # type: ignore[no-untyped-def]
    return problem_for("llama3-8b", "h100-80g-nvlink", tp=2, pp=2, mb=1, gb=8, seq=8192, sp=True, **opts)


def test_selective_with_flash_reruns_core_attn_per_layer_and_micro_batch() -> None:
    pb = _llama8b()
    g = pb.graph
    ca = g.op("core_attn")
    none, sel = plan(pb, "none", record=False), plan(pb, "selective", record=False)
    m = pb.parallel.num_microbatches
    for s, st in enumerate(sel.prediction.stages):
        n = sel.result.partition.layers_per_stage[s]
        # Megatron re-runs the flash kernel's forward in the backward of every layer of every micro-batch ...
        assert st.recompute_critical_s == pytest.approx(n * m * ca.fwd_time, rel=1e-9)
        assert st.recompute_critical_s > 0 and none.prediction.stages[s].recompute_critical_s == 0
    # ... and the iteration pays it (the stages are symmetric: 16 layers each)
    assert sel.prediction.iteration_time_s > none.prediction.iteration_time_s
    # Memory: the output projection holds the attention output; only the fp32 log-sum-exp is freed.
    lp = selective_layer(g)
    assert lp.rerun == frozenset({"core_attn"}) and "core_attn" in lp.keep and not lp.recompute
    assert layer_memory(g, lp).retained == pytest.approx(layer_memory(g, keep_all(g)).retained - ca.mask_bytes)
    assert ca.mask_bytes > 0 and ca.mask_bytes < ca.out_bytes / 32
    assert recompute_time(g, lp, (Phase.ON_DEMAND,)) == pytest.approx(ca.fwd_time)
    assert recompute_time(g, lp, (Phase.FWD_ATTN, Phase.BWD_ATTN)) == 0
    assert modules_layer(g, ("core_attn",)) == lp
    assert modules_layer(g, ("core_attn", "mlp")).rerun == frozenset({"core_attn"})
    assert modules_layer(g, ("mlp",)).rerun == frozenset()


def test_gpt_standard_attention_selective_is_unchanged() -> None:
    g = problem_for().graph
    lp = selective_layer(g)
    assert lp.rerun == frozenset() and {"softmax", "attn_scores"} <= set(lp.recomputed())
    assert "attn_context" in lp.keep


def test_rerun_round_trips_and_is_validated() -> None:
    g = _llama8b().graph
    lp = selective_layer(g)
    d = lp.to_dict(g)
    assert d["core_attn"] == "keep+rerun"
    assert LayerPolicy.from_dict(d) == lp
    assert validate_layer_policy(g, lp) == []
    bad = LayerPolicy(keep=lp.keep - {"core_attn"}, recompute=(("core_attn", Phase.ON_DEMAND),), rerun=lp.rerun)
    assert any("re-run but not kept" in e for e in validate_layer_policy(g, bad))
    ctx = _llama8b().stage_contexts(plan(_llama8b(), "selective", record=False).result.partition)[0]
    check_policy(g, RecomputePolicy("selective", (lp,) * ctx.num_layers), ctx)


def test_baselines_use_megatrons_even_split_and_lynx_keeps_its_partitioner() -> None:
    pb = problem_for(mb=16)  # the README's gpt-7b case: 32 layers over PP 4
    rows = {r.method: r for r in compare(pb, [*BASELINES, "lynx"])}
    for m in BASELINES:
        p = rows[m].plan
        assert p is not None, rows[m].error
        assert p.result.partition.layers_per_stage == (8, 8, 8, 8), m
    lynx = rows["lynx"].plan
    assert lynx is not None and lynx.result.partition.layers_per_stage != (8, 8, 8, 8)


def test_baselines_on_a_split_megatron_refuses_are_marked_not_invented() -> None:
    pb = problem_for(pp=3, mb=4, gb=48)  # 32 layers do not divide by PP 3
    rows = {r.method: r for r in compare(pb, ["none", "selective", "mc-mlp", "block", "lynx", "lynx-heu"])}
    for m in ("none", "selective", "mc-mlp", "block"):
        assert rows[m].plan is None and "Megatron refuses" in rows[m].error and "PP 3" in rows[m].error, m
    assert rows["lynx"].plan is not None and rows["lynx-heu"].plan is not None


def test_baselines_take_an_explicit_layout_and_interleaving() -> None:
    pb = problem_for(layers_per_stage=(7, 9, 9, 7))  # what --decoder-first/last-pipeline-num-layers 7 give
    assert plan(pb, "selective", record=False).result.partition.layers_per_stage == (7, 9, 9, 7)
    pv = problem_for(vpp=2)
    assert plan(pv, "full", record=False).result.partition.chunks == (4,) * 8
    pr = problem_for(pp=4, vpp=3)  # 32 layers over 12 virtual stages: Megatron refuses
    rows = compare(pr, ["none"])
    assert rows[0].plan is None and "PP 4 x VPP 3" in rows[0].error


def test_policy_table_shows_the_rerun() -> None:
    from rich.console import Console

    from lynx.report.tables import policy_table

    con = Console(record=True, width=400)
    con.print(policy_table(plan(_llama8b(), "selective", record=False)))
    text = con.export_text()
    assert "K5" in text and "keep and re-run" in text


def test_megatron_balancing_flags_move_only_the_stock_rows() -> None:
    pb = problem_for(mb=16, decoder_first_pipeline_num_layers=7, decoder_last_pipeline_num_layers=7)
    rows = {r.method: r for r in compare(pb, ["selective", "block", "lynx"])}
    for m in ("selective", "block"):
        p = rows[m].plan
        assert p is not None and p.result.partition.layers_per_stage == (7, 9, 9, 7)
    lynx = rows["lynx"].plan
    assert lynx is not None and lynx.result.partition.layers_per_stage == (8, 9, 8, 7)  # lynx's own search
    # Megatron-Core's rules: the embedding / loss count as a layer; the split must still divide
    acc = problem_for(pp=3, mb=4, gb=48, account_for_embedding_in_pipeline_split=True)  # 33 slots over PP 3
    assert plan(acc, "none", record=False).result.partition.layers_per_stage == (10, 11, 11)
    both = problem_for(pp=2, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    assert plan(both, "full", record=False).result.partition.layers_per_stage == (16, 16)  # 34 slots: 17 each
    bad = problem_for(account_for_embedding_in_pipeline_split=True)  # 33 slots over PP 4
    with pytest.raises(SpecError, match="Megatron refuses.*embedding/loss"):
        plan(bad, "none", record=False)
    odd = problem_for(decoder_first_pipeline_num_layers=6)  # 26 layers over 3 stages
    row = compare(odd, ["selective"])[0]
    assert row.plan is None and "Megatron refuses" in row.error and "6/None" in row.error
