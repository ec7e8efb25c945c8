"""Static memory per stage against Megatron-LM's published bytes-per-parameter table, and DP sharding."""

from __future__ import annotations

import pytest

from lynx.api import make_problem, plan
from lynx.breakdown import stage_memories
from lynx.cost.memory import stage_peak_bytes, static_bytes
from lynx.cost.static_memory import RECIPES, Precision, recipe_for, stage_params, stage_static
from lynx.errors import SpecError
from lynx.models import load_model, total_params
from lynx.problem import PlanOptions
from lynx.spec import GiB, ModelSpec, ParallelSpec, load_hardware

# Megatron-LM docs/source/api-guide/dist_optimizer.md: bytes per parameter, d = data-parallel size.
MEGATRON_TABLE = {
    Precision.MEGATRON_FP16: (lambda d: 20.0, lambda d: 4 + 16 / d),
    Precision.MEGATRON_BF16: (lambda d: 18.0, lambda d: 6 + 12 / d),
    Precision.FP32: (lambda d: 16.0, lambda d: 8 + 8 / d),
}


def _gpt_layer_params(h: int, t: int) -> float:
    """12h^2 + 13h per GPT layer (Narayanan et al. 2021), of which LayerNorms and the two row-parallel
    biases (6h) are replicated over TP and the rest split."""
    return (12 * h * h + 7 * h) / t + 6 * h


def _stage_param_count(m: ModelSpec, par: ParallelSpec, stage: int, n: int) -> float:
    """Independent count: layers, + word/position embedding on the first stage, + the final LayerNorm and
    (PP > 1) the tied LM head's copy of the word embedding on the last."""
    h, t = m.hidden_size, par.tp
    count = n * _gpt_layer_params(h, t)
    if stage == 0:
        count += m.vocab_size * h / t + m.max_position_embeddings * h
    if stage == par.pp - 1:
        count += 2 * h + (m.vocab_size * h / t if par.pp > 1 else 0)
    return count


@pytest.mark.parametrize("precision", list(MEGATRON_TABLE))
@pytest.mark.parametrize("dp", [1, 2, 8])
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_stage_static_is_megatrons_formula(precision: Precision, dp: int, stage: int) -> None:
    m = load_model("gpt-7b")
    par = ParallelSpec(tp=4, pp=4, dp=dp, global_batch_size=8 * dp)
    n = 8
    count = _stage_param_count(m, par, stage, n)
    plain, sharded = MEGATRON_TABLE[precision]
    # Megatron's formula counts the fp16 recipe's main-gradient copy, which only the optimizer step holds
    got = sum(static_bytes(m, par, stage, n, precision=precision.value, step_only=only) for only in (False, True))
    assert got == pytest.approx(plain(dp) * count, rel=1e-12)
    got_do = sum(static_bytes(m, par, stage, n, precision=precision.value, distributed_optimizer=True, step_only=only)
                 for only in (False, True))
    assert got_do == pytest.approx(sharded(dp) * count, rel=1e-12)


@pytest.mark.parametrize("do", [False, True])
def test_the_fp16_main_gradient_copy_is_the_steps_only(do: bool) -> None:
    """Megatron's fp16 optimizers copy the gradients to fp32 in the step and free the copy at the next zero_grad:
    4 bytes a parameter (over DP with the distributed optimizer) on the step's peak, not the forward's. bf16
    accumulates in its fp32 buffer already: nothing step-only."""
    m = load_model("gpt-7b")
    par = ParallelSpec(tp=4, pp=4, dp=2, global_batch_size=16)
    count = _stage_param_count(m, par, 1, 8)
    step = static_bytes(m, par, 1, 8, precision="megatron-fp16", distributed_optimizer=do, step_only=True)
    assert step == pytest.approx(4.0 * count / (2 if do else 1), rel=1e-12)
    assert static_bytes(m, par, 1, 8, precision="megatron-bf16", distributed_optimizer=do, step_only=True) == 0.0


def test_the_steps_copy_is_on_the_peak_and_a_step_that_does_not_fit_fits_nothing() -> None:
    """Planned: the simulated and closed-form peaks of every stage are at least static + the step's copy; with a
    budget between a stage's static memory and static + the step's copy, no plan fits there."""
    m = load_model("gpt-7b")
    hw = load_hardware("a100-80g-dgx")
    par = ParallelSpec(tp=4, pp=4, dp=2, micro_batch_size=1, global_batch_size=16, seq_length=1024)
    opts = PlanOptions(precision="megatron-fp16", distributed_optimizer=True)
    p = plan(make_problem(m, hw, par, opts), "full")
    for ctx, st in zip(p.problem.stage_contexts(p.result.partition), p.sim.stages, strict=True):
        assert ctx.step_bytes > 0
        assert st.peak_memory_bytes >= ctx.static_bytes + ctx.step_bytes
    ctx = p.problem.stage_contexts(p.result.partition)[1]
    tight = PlanOptions(precision="megatron-fp16", distributed_optimizer=True,
                        budget_bytes=ctx.static_bytes + ctx.step_bytes / 2)
    squeezed = make_problem(m, hw, par, tight)
    assert squeezed.stage_contexts(p.result.partition)[1].step_bytes == 0.0  # charged as static
    squeezed_plan = plan(squeezed, "full")
    assert squeezed_plan.sim.stages[1].oom
    # `lynx memory` shows what the planner charged: the copy in the optimizer column, the closed-form peak
    ctx1 = squeezed.stage_contexts(p.result.partition)[1]
    st = stage_memories(squeezed_plan)[1]
    assert st.static.total == pytest.approx(ctx1.static_bytes, rel=1e-12)
    assert st.peak == pytest.approx(stage_peak_bytes(squeezed.graph, squeezed_plan.result.policies[1].layers, ctx1),
                                    rel=1e-12)


def test_fsdp_prices_the_fp16_state_whole_with_no_step_only_part() -> None:
    from lynx.cost.fsdp import FSDP2

    m = load_model("gpt-7b")
    par = ParallelSpec(tp=4, pp=1, dp=4, micro_batch_size=1, global_batch_size=16, seq_length=1024)
    problem = make_problem(m, load_hardware("a100-80g-dgx"), par,
                           PlanOptions(precision="megatron-fp16", dp_sharding=FSDP2))
    p = plan(problem, "full")
    ctx = problem.stage_contexts(p.result.partition)[0]
    assert ctx.step_bytes == 0.0
    st = stage_memories(p)[0]
    assert st.static.step_bytes == 0.0 and st.static.total == pytest.approx(ctx.static_bytes, rel=1e-12)
    assert st.peak == pytest.approx(stage_peak_bytes(problem.graph, p.result.policies[0].layers, ctx), rel=1e-12)


def test_paper_recipe_is_zero_16_bytes_and_zero1_shards_12() -> None:
    m = load_model("gpt-1.3b")
    par = ParallelSpec(dp=4, global_batch_size=4)
    total = total_params(m)
    assert static_bytes(m, par, 0, m.num_layers) == pytest.approx(16 * total, rel=1e-12)
    # ZeRO stage 1 (Rajbhandari et al. 2020, Fig. 1): (2 + 2) + 12 / Nd
    assert static_bytes(m, par, 0, m.num_layers, distributed_optimizer=True) == pytest.approx(
        (4 + 12 / 4) * total, rel=1e-12)


def test_breakdown_buffers_and_head_copy() -> None:
    m = load_model("gpt-7b")
    par = ParallelSpec(tp=2, pp=2, dp=4, global_batch_size=4)
    b = stage_static(m, par, 1, 16, RECIPES[Precision.MEGATRON_BF16], distributed_optimizer=True)
    n = b.params.total
    assert b.params.head == pytest.approx(m.vocab_size * m.hidden_size / 2)  # tied copy on the last stage
    assert (b.param_bytes, b.grad_bytes) == pytest.approx((2 * n, 4 * n))
    assert b.optimizer_bytes == pytest.approx(12 * n / 4)
    assert b.total == pytest.approx((6 + 12 / 4) * n)
    # PP = 1 with tied embeddings: one copy, no head
    assert stage_params(m, ParallelSpec(tp=2), 0, m.num_layers).head == 0.0


def test_bytes_per_param_override_and_bad_recipes() -> None:
    m = load_model("gpt-7b")
    par = ParallelSpec(tp=1, pp=1)
    assert static_bytes(m, par, 0, m.num_layers, bytes_per_param=18) == pytest.approx(18 * total_params(m))
    assert recipe_for("megatron-bf16", 20.0).total == 20.0
    with pytest.raises(SpecError, match="--precision 'bf16'"):
        recipe_for("bf16")
    with pytest.raises(SpecError, match="--bytes-per-param 3"):
        recipe_for("paper", 3.0)


def test_planner_shards_over_dp_where_asked() -> None:
    """GPT-23B, megatron-bf16, 20 GiB per GPU: with DP 1 the stages do not fit (~25 GiB); the distributed
    optimizer at DP 2 and 4 brings static memory down until they do; without it DP changes nothing."""
    m, hw = load_model("gpt-23b"), load_hardware("a100-40g-nvlink")

    def run(dp: int, dist: bool) -> tuple[bool, float]:
        par = ParallelSpec(tp=4, pp=4, dp=dp, micro_batch_size=1, global_batch_size=16 * dp, seq_length=1024)
        # 50 layers over PP 4: Megatron needs --decoder-first/last-pipeline-num-layers 12 (13 in the middle)
        opts = PlanOptions(precision="megatron-bf16", distributed_optimizer=dist, nodes=16, budget_bytes=20 * GiB,
                           layers_per_stage=(12, 13, 13, 12))
        p = plan(make_problem(m, hw, par, opts), "full", record=False)
        return p.sim.oom, max(s.static_bytes for s in p.sim.stages)

    oom1, st1 = run(1, True)
    oom2, st2 = run(2, True)
    oom4, st4 = run(4, True)
    oom4_plain, st4_plain = run(4, False)
    assert oom1 and not oom2 and not oom4 and oom4_plain
    assert st4 < st2 < st1 == pytest.approx(st4_plain)
    assert st4 == pytest.approx(st1 * (6 + 12 / 4) / 18, rel=1e-9)


def test_plan_file_keeps_the_recipe(tmp_path: object) -> None:
    from pathlib import Path

    from lynx.plan import Plan, load_plan

    par = ParallelSpec(tp=2, pp=2, dp=2, micro_batch_size=2, global_batch_size=16)
    opts = PlanOptions(precision="megatron-bf16", distributed_optimizer=True)
    p = plan(make_problem(load_model("gpt-1.3b"), load_hardware("a100-40g-nvlink"), par, opts), "full")
    path = Path(str(tmp_path)) / "p.json"
    p.save(path)
    problem, result = load_plan(path)
    assert (problem.options.precision, problem.options.distributed_optimizer) == ("megatron-bf16", True)
    again = Plan.evaluate(problem, result)
    assert [s.static_bytes for s in again.sim.stages] == [s.static_bytes for s in p.sim.stages]
    assert again.sim.iteration_time_s == p.sim.iteration_time_s
