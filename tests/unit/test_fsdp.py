"""Fully sharded data parallelism (`lynx.cost.fsdp`, `lynx.cost.fsdp_time`): the bytes and seconds against hand
computations, the window it gives on-demand recomputation, Megatron's flags read and written, the search's
sharding dimension, and the refusals."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lynx.cost.fsdp import FSDP2, DpMode, DpSharding, Sharding, sharded_static
from lynx.cost.fsdp_time import fsdp_charge, fsdp_tail
from lynx.cost.stage import layer_cost, stage_costs
from lynx.cost.static_memory import recipe_for, stage_params
from lynx.cost.titan_fsdp import Reshard, fsdp_static, titan_setting
from lynx.decisions import RecomputePolicy
from lynx.errors import SpecError
from lynx.export.megatron_args import parse_megatron_args
from lynx.export.megatron_fsdp import sharding_flags
from lynx.families import get_family
from lynx.models import load_model
from lynx.policy.rules import full_layer
from lynx.policy.rules import keep_all as keep
from lynx.problem import PlanOptions, PlanProblem
from lynx.request import Request
from lynx.spec import ParallelSpec, load_hardware
from tests.harness.cli import run_main

H100 = "h100-80g-nvlink"
PAR = ParallelSpec(tp=1, pp=1, dp=8, micro_batch_size=1, global_batch_size=16, seq_length=8192)
BF16 = recipe_for("megatron-bf16")


def _ring(nbytes: float, n: int, bw: float, lat: float) -> float:
    """A ring all-gather / reduce-scatter by hand: (n-1) steps of nbytes/n."""
    return (n - 1) * lat + (n - 1) / n * nbytes / bw


def test_per_layer_gather_and_reduce_are_rings_of_one_layers_bytes() -> None:
    m, hw = load_model("llama3-8b"), load_hardware(H100)
    n_layer = get_family(m.family).layer_params(m, 1)
    link = hw.link_for_group(8, 1)
    bw = link.bandwidth_Bps * link.gather_eff
    c = fsdp_charge(m, hw, PAR, 0, BF16, FSDP2)
    assert c.gather_fwd_s == pytest.approx(_ring(2 * n_layer, 8, bw, link.latency_s))
    assert c.gather_bwd_s == c.gather_fwd_s  # resharded after forward without a pipeline
    assert c.reduce_s == pytest.approx(_ring(4 * n_layer, 8, bw, link.latency_s))  # fp32 reduce_dtype
    emb = get_family(m.family).embedding_params(m, 1)
    assert c.start_s == pytest.approx(_ring(2 * emb, 8, bw, link.latency_s))  # stage 0 opens with the embedding
    # Megatron-FSDP's optim_grads: no parameter gathers, the gradient in Megatron's buffer dtype (fp32 here)
    og = fsdp_charge(m, hw, PAR, 0, BF16, DpSharding(DpMode.MEGATRON_FSDP, Sharding.OPTIM_GRADS))
    assert (og.gather_fwd_s, og.gather_bwd_s) == (0.0, 0.0) and og.reduce_s == pytest.approx(c.reduce_s)
    # ... and the replicated parameters are all-gathered once after the sharded step, the first forward hiding it
    tail = fsdp_tail(m, hw, PAR, 0, 32, BF16, DpSharding(DpMode.MEGATRON_FSDP, Sharding.OPTIM_GRADS))
    n = stage_params(m, PAR, 0, 32).total
    assert tail.grad_s == 0.0 and tail.param_s == pytest.approx(_ring(2 * n, 8, bw, link.latency_s))


def test_hsdp_shards_inside_a_node_and_all_reduces_over_the_replicas() -> None:
    m, hw = load_model("llama3-8b"), load_hardware(H100)
    par = replace(PAR, dp=16, global_batch_size=32)
    ds = DpSharding(DpMode.TORCH_FSDP2, instances=2)
    n_layer = get_family(m.family).layer_params(m, 1)
    shard, rep = hw.link_for_group(8, 1), hw.link_for_group(2, 8)
    assert rep is hw.inter_node and shard is not hw.inter_node
    c = fsdp_charge(m, hw, par, 1, BF16, ds)
    ar = 2 * rep.latency_s + 4 * n_layer / 8 / (rep.bandwidth_Bps * rep.efficiency)  # ring all-reduce over 2
    assert c.reduce_s == pytest.approx(_ring(4 * n_layer, 8, shard.bandwidth_Bps * shard.gather_eff,
                                             shard.latency_s) + ar)


def test_megatron_fsdp_strategies_shard_what_they_name() -> None:
    m = load_model("llama3-8b")
    n = stage_params(m, PAR, 0, 32).total
    n_layer = get_family(m.family).layer_params(m, 1)
    st = {s: sharded_static(m, PAR, 0, 32, BF16, DpSharding(DpMode.MEGATRON_FSDP, s)) for s in Sharding}
    assert st[Sharding.NO_SHARD].total == pytest.approx(18 * n)
    assert st[Sharding.OPTIM].total == pytest.approx(6 * n + 12 * n / 8)  # Megatron's 6 + 12/d
    assert st[Sharding.OPTIM_GRADS].total == pytest.approx(2 * n + 16 * n / 8 + 4 * n_layer)
    zero3 = st[Sharding.OPTIM_GRADS_PARAMS]
    assert zero3.optimizer == pytest.approx(18 * n / 8) and zero3.total < st[Sharding.OPTIM_GRADS].total


def test_torch_fsdp2_is_torchtitans_byte_model() -> None:
    """One model where they agree: FSDP2 through `sharded_static` is `titan_fsdp.fsdp_static` exactly."""
    m = load_model("torchtitan-llama3-8b")
    for par in (PAR, replace(PAR, pp=2, dp=4, global_batch_size=16)):
        want = fsdp_static(m, par, par.pp - 1, 16, titan_setting(par, True)).total
        got = sharded_static(m, par, par.pp - 1, 16, BF16, FSDP2).total
        assert got == pytest.approx(want)


def test_fsdp_window_hides_on_demand_recomputation_and_is_charged_otherwise() -> None:
    m, hw = load_model("llama3-8b"), load_hardware("a100-40g-pcie")  # a slow link: FSDP outlasts the backward
    opts = PlanOptions(precision="megatron-bf16", dp_sharding=FSDP2)
    prob = Request(m, hw, PAR, opts).problem()
    ctx = prob.stage_context(0, 32)
    assert ctx.fsdp is not None
    lc = layer_cost(prob.graph, ctx.subtract_wgrad)
    comm_b = ctx.fsdp.gather_bwd_s + ctx.fsdp.reduce_s
    assert comm_b > lc.bwd  # the case with a window
    keep = stage_costs(prob.graph, _policy(prob, keep_all=True), ctx)[0]
    full = stage_costs(prob.graph, _policy(prob, keep_all=False), ctx)[0]
    # without recomputation each backward step lasts the collectives; full recomputation hides in them up to
    # the window and runs on demand beyond it
    assert keep.bwd_base == pytest.approx(ctx.fsdp.end_s + 32 * comm_b)
    od = (full.bwd_ondemand + full.bwd_hidden) / 32
    assert full.bwd_hidden == pytest.approx(32 * min(od, comm_b - lc.bwd)) and full.bwd_hidden > 0
    assert full.bwd_base == pytest.approx(ctx.fsdp.end_s + 32 * max(comm_b, lc.bwd + od))
    fwd_exposed = max(0.0, ctx.fsdp.gather_fwd_s - lc.fwd)
    assert keep.fwd_plain == pytest.approx(ctx.fsdp.start_s + 32 * (lc.fwd + fwd_exposed))


def _policy(prob: PlanProblem, keep_all: bool) -> RecomputePolicy:
    lp = keep(prob.graph) if keep_all else full_layer(prob.graph)
    return RecomputePolicy("test", (lp,) * 32)


def test_from_megatron_reads_the_sharding_and_export_writes_it_back() -> None:
    base = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --micro-batch-size 1 "
            "--global-batch-size 8 --vocab-size 1024 ")
    cmd = parse_megatron_args(base + "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads "
                                     "--num-distributed-optimizer-instances 2")
    assert cmd.run.dp_sharding == DpSharding(DpMode.MEGATRON_FSDP, Sharding.OPTIM_GRADS, 2)
    assert not any("fsdp" in w or "instances" in w for w in cmd.warnings)
    assert sharding_flags(cmd.run.dp_sharding) == [("--use-megatron-fsdp",), ("--data-parallel-sharding-strategy",
                                                   "optim_grads"), ("--use-distributed-optimizer",),
                                                   ("--num-distributed-optimizer-instances", "2")]
    # Megatron's torch FSDP2 reshards after every forward unless told not to (its reshard_after_forward default),
    # pipeline or not; torchtitan's default (FSDP2 here) keeps the gathered layers with a pipeline
    torch2 = parse_megatron_args(base + "--use-torch-fsdp2").run.dp_sharding
    assert torch2 == DpSharding(DpMode.TORCH_FSDP2, reshard=Reshard.ALWAYS) and torch2.reshards(4)
    kept = parse_megatron_args(base + "--use-torch-fsdp2 --torch-fsdp2-no-reshard-after-forward").run.dp_sharding
    assert kept.reshard is Reshard.NEVER and not kept.reshards(1)
    for ds in (FSDP2, DpSharding(DpMode.TORCH_FSDP2, instances=4), DpSharding(DpMode.MEGATRON_FSDP, Sharding.OPTIM),
               DpSharding(DpMode.TORCH_FSDP2, reshard=Reshard.NEVER)):
        for pp in (1, 4):  # what export writes reads back as the same sharding on that pipeline
            written = " ".join(t for f in sharding_flags(ds, pp) for t in f)
            back = parse_megatron_args(base + written).run.dp_sharding
            assert (back.mode, back.effective_strategy, back.instances, back.reshards(pp)) == \
                (ds.mode, ds.effective_strategy, ds.instances, ds.reshards(pp)), (ds, pp, written)
    assert ("--torch-fsdp2-no-reshard-after-forward",) in sharding_flags(FSDP2, 4)  # torchtitan's default, PP 4
    for bad, says in (("--use-torch-fsdp2 --use-megatron-fsdp", "pick one"),
                      ("--use-megatron-fsdp --data-parallel-sharding-strategy zero3", "valid: no_shard"),
                      ("--data-parallel-sharding-strategy optim", "needs --use-megatron-fsdp"),
                      ("--use-torch-fsdp2 --data-parallel-sharding-strategy optim", "always shards"),
                      ("--use-megatron-fsdp --outer-dp-sharding-strategy optim", "not modelled"),
                      ("--torch-fsdp2-no-reshard-after-forward", "needs --use-torch-fsdp2")):
        with pytest.raises(SpecError, match=says):
            parse_megatron_args(base + bad)


def test_export_megatron_writes_the_plans_sharding() -> None:
    from lynx.export.megatron import run_flags

    opts = PlanOptions(dp_sharding=DpSharding(DpMode.TORCH_FSDP2, instances=2))
    flags = run_flags(opts, PAR)
    assert ("--use-torch-fsdp2",) in flags and ("--num-distributed-optimizer-instances", "2") in flags
    mf = PlanOptions(distributed_optimizer=True, dp_sharding=DpSharding(DpMode.MEGATRON_FSDP))
    assert run_flags(mf, PAR).count(("--use-distributed-optimizer",)) == 1


def test_search_has_an_fsdp_dimension_and_prices_it() -> None:
    from lynx.search import Pins, Space, search
    from lynx.search.space import candidates

    m, hw = load_model("llama-tiny"), load_hardware(H100)
    space = Space(m, hw, 8, 16, 512, Pins(tp=1, pp=1, mb=2, methods=("none",)))
    cands, _ = candidates(space)
    assert {(c.layout.fsdp, c.layout.dist_opt) for c in cands} == {(False, False), (False, True), (True, False)}
    res = search(space, PlanOptions(precision="megatron-bf16"), top=3)
    fsdp = [o for o in res.outcomes if o.candidate.layout.fsdp]
    ddp = [o for o in res.outcomes if not o.candidate.layout.fsdp and not o.candidate.layout.dist_opt]
    assert fsdp and ddp and fsdp[0].status == "planned" and fsdp[0].iteration_s > 0
    assert fsdp[0].iteration_s != ddp[0].iteration_s  # priced with its own collectives
    only, _ = candidates(replace(space, pins=replace(space.pins, fsdp=True)))
    assert only and all(c.layout.fsdp for c in only)


def test_cli_refuses_a_bad_sharding_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--model", "llama-tiny", "--hardware", H100, "--tp", "1", "--pp", "1", "--dp", "8",
            "--global-batch", "16", "--seq-len", "512", "--micro-batch", "2"]
    for extra, says in ((["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "zero3"], "valid: no_shard"),
                        (["--use-torch-fsdp2", "--num-distributed-optimizer-instances", "3"], "does not divide")):
        code, out, err = run_main(base + extra, capsys)
        assert code == 2 and out == "" and err.startswith("lynx: error:") and says in err
        assert len(err.strip().splitlines()) == 1
    code, out, _ = run_main(base + ["--use-torch-fsdp2", "--json"], capsys)
    assert code == 0 and "iteration" in out


def test_heu_places_recomputation_in_the_fsdp_window() -> None:
    """HEU's objective and its MILP see the window the simulator charges: on a link where FSDP outlasts each
    layer's backward, a budget that forces recomputation costs no critical time."""
    from lynx.cost.fsdp import DDP
    from lynx.policy.heu_objective import critical_recompute

    m, hw = load_model("llama3-8b"), load_hardware("a100-40g-pcie")
    par = replace(PAR, seq_length=4096)
    fsdp = Request(m, hw, par, PlanOptions(precision="megatron-bf16", dp_sharding=FSDP2)).problem()
    ctx = fsdp.stage_context(0, 32)
    full = (full_layer(fsdp.graph),) * 32
    assert critical_recompute(fsdp.graph, full, ctx) == 0.0
    assert critical_recompute(fsdp.graph, full, replace(ctx, fsdp=None)) > 0.0
    tight = PlanOptions(precision="megatron-bf16", dp_sharding=FSDP2, budget_bytes=30 * 2**30)
    plan = Request(m, hw, par, tight).plan()
    st = plan.prediction.stages[0]
    assert st.recompute_overlapped_s > 0.0 and st.recompute_critical_s == 0.0
    assert Request(m, hw, par, replace(tight, dp_sharding=DDP, distributed_optimizer=True)).problem() \
        .stage_context(0, 32).fsdp is None


def test_plan_file_keeps_the_sharding_and_lynx_memory_itemizes_it(tmp_path: Path) -> None:
    from lynx.breakdown import stage_memories
    from lynx.plan import load_plan

    m, hw = load_model("llama3-8b"), load_hardware(H100)
    ds = DpSharding(DpMode.MEGATRON_FSDP, Sharding.OPTIM_GRADS_PARAMS)
    plan = Request(m, hw, PAR, PlanOptions(precision="megatron-bf16", dp_sharding=ds)).plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    problem, _ = load_plan(path)
    assert problem.options.dp_sharding == ds
    (st,) = stage_memories(plan)
    assert st.static.total == pytest.approx(plan.problem.stage_context(0, 32).static_bytes)


def test_torchtitan_family_pays_fsdp2s_collectives_as_its_export_configures_them() -> None:
    """torchtitan always runs FSDP2 (decision 0102): without --distributed-optimizer the export writes HSDP that
    replicates over DP (shard 1: an all-reduce per layer, no gathers); with it, FSDP over DP (gathers and
    reduce-scatters)."""
    m, hw = load_model("torchtitan-llama3-8b"), load_hardware(H100)
    n_layer = get_family(m.family).layer_params(m, 1)
    link = hw.link_for_group(8, 1)
    rep = Request(m, hw, PAR, PlanOptions(precision="megatron-bf16")).problem().stage_context(0, 32).fsdp
    assert rep is not None and rep.gather_fwd_s == rep.gather_bwd_s == 0.0
    assert rep.reduce_s == pytest.approx(14 * link.latency_s + 2 * 7 / 8 * 4 * n_layer / link.effective_Bps)
    sharded = Request(m, hw, PAR, PlanOptions(precision="megatron-bf16", distributed_optimizer=True)).problem()
    ch = sharded.stage_context(0, 32).fsdp
    assert ch is not None and ch.gather_fwd_s > 0 and ch.reduce_s < rep.reduce_s


def test_megatron_fsdp_dtype_flags_set_its_buffers_and_its_reduction() -> None:
    """Megatron-FSDP's --megatron-fsdp-{main-params,main-grads,grad-comm}-dtype (later Megatron-LM): the gradient
    buffer, the main weights and the reduce-scatter's bytes, read and written back like the strategy."""
    from lynx.cost.fsdp_time import reduce_bytes

    m = load_model("llama3-8b")
    n = stage_params(m, PAR, 0, 32).total
    zero2 = DpSharding(DpMode.MEGATRON_FSDP, Sharding.OPTIM_GRADS)
    base = sharded_static(m, PAR, 0, 32, BF16, zero2)
    grads = replace(zero2, main_grads_dtype="bf16")
    assert sharded_static(m, PAR, 0, 32, BF16, grads).grads == pytest.approx(base.grads / 2)
    auto = replace(zero2, main_params_dtype="auto")  # the compute weights are the main weights: no fp32 copy
    assert base.optimizer - sharded_static(m, PAR, 0, 32, BF16, auto).optimizer == pytest.approx(4 * n / 8)
    assert reduce_bytes(BF16, zero2) == 4.0 and reduce_bytes(BF16, grads) == 2.0
    assert reduce_bytes(BF16, replace(zero2, grad_comm_dtype="bf16")) == 2.0
    assert reduce_bytes(BF16, replace(grads, grad_comm_dtype="fp32")) == 4.0
    assert reduce_bytes(BF16, replace(FSDP2, main_grads_dtype="bf16")) == 4.0  # torch FSDP2: never these flags
    text = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --micro-batch-size 1 "
            "--global-batch-size 8 --vocab-size 1024 ")
    ds = replace(zero2, main_grads_dtype="bf16", grad_comm_dtype="auto", main_params_dtype="fp32")
    written = " ".join(t for f in sharding_flags(ds) for t in f)
    assert "--megatron-fsdp-main-grads-dtype bf16" in written
    cmd = parse_megatron_args(text + written)
    assert cmd.run.dp_sharding == ds and not any("megatron-fsdp" in w for w in cmd.warnings)
    for bad, says in (("--megatron-fsdp-main-grads-dtype bf16", "needs --use-megatron-fsdp"),
                      ("--use-megatron-fsdp --megatron-fsdp-grad-comm-dtype fp8", "valid: fp32, bf16, fp16, auto")):
        with pytest.raises(SpecError, match=says):
            parse_megatron_args(text + bad)
