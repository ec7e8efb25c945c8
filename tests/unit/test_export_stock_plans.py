"""Decision 0278: a plan made by one of Megatron-Core's own settings (`--method full`, `selective`, an `mc-*` module
list) is exported and priced for `--target megatron` as that setting, not as the fastest setting that fits (another
configuration, which the search prices as its own candidate); and a module list with core attention re-runs the
context-parallel K/V exchange with it, as TransformerEngine's attention does."""

from __future__ import annotations

import pytest

from lynx.api import make_problem
from lynx.api import plan as plan_with
from lynx.export.megatron import build_megatron, megatron_run
from lynx.export.source import source_from
from lynx.models import load_model
from lynx.problem import PlanOptions
from lynx.spec import ParallelSpec, load_hardware
from tests.conftest import problem_for


@pytest.mark.parametrize(("model", "method", "flags"), [
    ("gpt-7b", "full", "--recompute-granularity full --recompute-method block --recompute-num-layers 8"),
    ("gpt-7b", "mc-mlp", "--recompute-granularity selective --recompute-modules mlp"),
    # flash attention keeps no scores, so lynx's keep set of `selective` is that of `none`; Megatron re-runs the
    # kernel all the same, and the plan priced that re-run
    ("llama3-8b", "selective", "--recompute-granularity selective --recompute-modules core_attn"),
])
def test_a_stock_plan_exports_its_own_flags_at_its_own_price(model: str, method: str, flags: str) -> None:
    p = plan_with(problem_for(model=model, mb=1, gb=32), method, record=False)
    exp = build_megatron(source_from(p.problem, p.result))
    assert flags in exp.args_text().replace("\n", " ")
    fig, plugin = megatron_run(source_from(p.problem, p.result))
    assert not plugin
    assert fig.iteration_time_s == pytest.approx(p.sim.iteration_time_s, rel=1e-9)
    assert [s.peak_bytes for s in fig.stages] == pytest.approx([s.peak_memory_bytes for s in p.sim.stages], rel=1e-9)


def test_module_lists_with_core_attention_rerun_the_context_parallel_exchange() -> None:
    par = ParallelSpec(tp=1, pp=1, dp=2, cp=2, micro_batch_size=1, global_batch_size=8, seq_length=4096)
    prob = make_problem(load_model("llama3-8b"), load_hardware("h100-80g-nvlink"), par, PlanOptions())
    p = plan_with(prob, "mc-core_attn+mlp", record=False)  # refused by the policy check before
    layer = p.result.policies[0].layers[0]
    assert "core_attn" in layer.rerun and any(n == "cp_kv_exchange" for n, _ in layer.recompute)


def test_stock_offloading_over_context_parallel_a2a_exports_what_it_planned() -> None:
    """With --cp-comm-type a2a the attention's inputs are inside core attention: Megatron's core_attn entry moves
    nothing more, but attn_proj (the exchanged attention output) needs it listed. The export kept attn_proj out and
    priced less offloading than mc-offload planned."""
    par = ParallelSpec(tp=1, pp=2, dp=1, cp=2, cp_comm_type="a2a", micro_batch_size=16, global_batch_size=16,
                       seq_length=512)
    prob = make_problem(load_model("llama-tiny"), load_hardware("h100-80g-nvlink"), par,
                        PlanOptions(precision="megatron-bf16", distributed_optimizer=True))
    p = plan_with(prob, "mc-offload", record=False)
    src = source_from(p.problem, p.result)
    text = build_megatron(src).args_text()
    assert "--offload-modules qkv_linear core_attn attn_proj mlp_norm" in text.replace("\n", " ")
    fig, _ = megatron_run(src)
    assert fig.iteration_time_s == pytest.approx(p.sim.iteration_time_s, rel=1e-9)
