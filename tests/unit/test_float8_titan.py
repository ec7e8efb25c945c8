"""torchtitan's torch.compile and torchao's Float8 linear layers, priced (lynx.cost.float8_torchao, decision 0268).

The expected bytes are written out from the module's table (torchao's ``matmul_with_hp_or_float8_args``: the 16-bit
input and weight kept, every FP8 copy made again in backward; a row-wise quantization one pass, a column-wise one
an amax pass and a cast), not read off lynx's graph."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from lynx.cost.float8_torchao import RULES, apply_torchao
from lynx.cost.fp8_memory import gathered_param_bytes
from lynx.cost.fsdp import FSDP2
from lynx.cost.fsdp_time import fsdp_charge
from lynx.cost.layer import build_layer_graph
from lynx.cost.static_memory import recipe_for
from lynx.errors import SpecError
from lynx.families import get_family
from lynx.fp8 import Fp8, Fp8Engine, Fp8Format, Fp8Recipe, float8_from_flags, fp8_from_flags
from lynx.graph import LayerGraph
from lynx.models import load_model, model_from_dict
from lynx.spec import ModelSpec, ParallelSpec, load_hardware, model_to_dict

H100 = load_hardware("h100-80g-nvlink")
TW, RW, GW = Fp8Recipe.TENSORWISE, Fp8Recipe.ROWWISE, Fp8Recipe.ROWWISE_GW_HP


def _ao(recipe: Fp8Recipe, all_gather: bool = False) -> Fp8:
    return Fp8(Fp8Format.HYBRID, recipe, all_gather, Fp8Engine.TORCHAO)


def _titan(fp8: Fp8 | None = None, compiled: bool = True, **kw: bool) -> ModelSpec:
    return replace(load_model("torchtitan-llama3-8b"), fp8=fp8, compiled=compiled, **kw)


def _par(tp: int = 1, sp: bool = False, dp: int = 8) -> ParallelSpec:
    return ParallelSpec(tp=tp, pp=1, dp=dp, sequence_parallel=sp, micro_batch_size=1, global_batch_size=dp,
                        seq_length=4096)


def _kept(g: LayerGraph) -> float:
    return g.retained_bytes(g.needed())


@pytest.mark.parametrize("recipe", [TW, RW, GW])
def test_each_quantization_moves_the_tables_bytes(recipe: Fp8Recipe) -> None:
    """The MLP's gate and up share one input: one input quantization, one per weight and output gradient."""
    m, par = _titan(), _par()
    spec = get_family(m.family).layer(m, par)
    out = {o.name: o for o in apply_torchao(spec, _ao(recipe)).ops}
    tok, h, f = 4096, m.hidden_size, m.ffn_hidden_size
    fwd = {TW: 5, RW: 3, GW: 3}[recipe]
    w_dgrad = {TW: 3, RW: 5, GW: 5}[recipe]
    grad = {TW: 5 + 3, RW: 3 + 5, GW: 3}[recipe]  # for dgrad, then for wgrad
    in_wgrad = {TW: 3, RW: 5, GW: 0}[recipe]
    cast = out["gate_fp8"]
    assert "up_fp8" not in out
    assert cast.mem_bytes == pytest.approx(fwd * tok * h + 2 * fwd * h * f)
    assert cast.bwd_mem_bytes == pytest.approx(in_wgrad * tok * h + 2 * grad * tok * f + 2 * w_dgrad * h * f)
    assert out["gate"].fp8 and out["up"].fp8 and out["gate"].inputs == ("gate_fp8",)
    assert out["gate"].fp8_wgrad is (recipe is not GW) and RULES[recipe].fp8_wgrad is (recipe is not GW)


@pytest.mark.parametrize("recipe", [TW, RW, GW])
def test_backward_keeps_the_16_bit_tensors(recipe: Fp8Recipe) -> None:
    """torchao keeps the 16-bit input: a layer keeps what the 16-bit layer keeps (no FP8 copy held)."""
    par = _par()
    assert _kept(build_layer_graph(_titan(_ao(recipe)), H100, par)) == _kept(build_layer_graph(_titan(), H100, par))


def test_tensorwise_tensor_parallel_gathers_and_keeps_fp8() -> None:
    """torchtitan's float8 TP plan: the sequence-parallel shard quantized, gathered in FP8 and the gathered FP8
    kept (1 byte a token-element where the 16-bit layer keeps 2); rowwise gathers in 16 bits."""
    par = _par(tp=8, sp=True)
    tw = build_layer_graph(_titan(_ao(TW)), H100, par)
    rw = build_layer_graph(_titan(_ao(RW)), H100, par)
    bf = build_layer_graph(_titan(), H100, par)
    tok, h = 4096, 4096
    assert tw.op("mlp_allgather").out_bytes == tok * h
    assert rw.op("mlp_allgather").out_bytes == bf.op("mlp_allgather").out_bytes == 2 * tok * h
    assert tw.op("mlp_allgather").fwd_time < bf.op("mlp_allgather").fwd_time
    assert _kept(bf) - _kept(tw) == pytest.approx(2 * tok * h)  # both gathered inputs: qkv's and the MLP's
    assert _kept(rw) == _kept(bf)


def test_gw_hp_runs_the_weight_gradient_in_16_bits() -> None:
    par = _par()
    gw = build_layer_graph(_titan(_ao(GW)), H100, par).op("down")
    rw = build_layer_graph(_titan(_ao(RW)), H100, par).op("down")
    bf = build_layer_graph(_titan(), H100, par).op("down")
    assert gw.wgrad_time == pytest.approx(bf.wgrad_time)
    assert rw.wgrad_time < 0.7 * bf.wgrad_time
    assert gw.bwd_time - gw.wgrad_time == pytest.approx(rw.bwd_time - rw.wgrad_time)  # dgrad at the FP8 rate


def test_fsdp_float8_all_gather_moves_one_byte_per_gemm_weight() -> None:
    m, par = _titan(_ao(TW)), _par(dp=64)
    rec = recipe_for("megatron-bf16")
    plain = fsdp_charge(m, H100, par, 0, rec, FSDP2)
    fp8 = fsdp_charge(replace(m, fp8=_ao(TW, all_gather=True)), H100, par, 0, rec, FSDP2)
    assert fp8.gather_fwd_s < 0.7 * plain.gather_fwd_s  # a ring's steps also cost their latency
    n = get_family(m.family).layer_params(m, 1)
    gemm = n - 2 * m.hidden_size  # all but the two norms' weights
    fp8_bytes = gathered_param_bytes(fp8_model := replace(m, fp8=_ao(TW, all_gather=True)), par, n, n, 2.0)
    assert fp8_bytes == pytest.approx(gemm * 1.0 + 2 * m.hidden_size * 2.0)
    assert gathered_param_bytes(m, par, n, n, 2.0) == 2.0 * n  # without the all-gather: 16 bits
    assert fsdp_charge(fp8_model, H100, par, 0, rec, FSDP2) == fp8


def test_compiled_block_fuses_the_eager_ops() -> None:
    par = _par()
    eager = build_layer_graph(_titan(compiled=False, norm_fusion=False, kv_repeat=True), H100, par)
    comp = build_layer_graph(_titan(compiled=True, norm_fusion=False, kv_repeat=True), H100, par)
    names = {o.name for o in comp.ops}
    assert "silu" not in names and comp.op("swiglu").inputs == ("gate", "up")
    assert comp.op("rmsnorm1").fwd_time < 0.25 * eager.op("rmsnorm1").fwd_time  # one fused kernel
    assert sum(o.fwd_time + o.bwd_time for o in comp.ops) < sum(o.fwd_time + o.bwd_time for o in eager.ops)
    for name in ("wq", "core_attn", "gate", "down"):  # the GEMMs and attention are the same kernels
        assert comp.op(name).fwd_time == eager.op(name).fwd_time


def test_settings_round_trip_and_a_te_plan_is_written_as_before() -> None:
    m = _titan(_ao(TW, all_gather=True))
    d = model_to_dict(m)
    assert d["fp8"]["engine"] == "torchao" and d["compiled"] is True
    assert model_from_dict(d) == m
    te = model_to_dict(replace(load_model("llama3-8b"), fp8=Fp8()))
    assert "engine" not in te["fp8"] and "compiled" not in te


@pytest.mark.parametrize(("make", "says"), [
    (lambda: Fp8(Fp8Format.HYBRID, RW), "not a te recipe"),
    (lambda: Fp8(Fp8Format.HYBRID, Fp8Recipe.DELAYED, False, Fp8Engine.TORCHAO), "not a torchao recipe"),
    (lambda: _ao(RW, all_gather=True), "needs torchao's tensorwise"),
    (lambda: float8_from_flags("blockwise", False), "--float8-recipe 'blockwise'; valid: tensorwise, rowwise"),
    (lambda: float8_from_flags(None, True), "--float8-fsdp-all-gather needs --float8-recipe tensorwise"),
    (lambda: float8_from_flags("rowwise", True), "--float8-fsdp-all-gather needs --float8-recipe tensorwise, got"),
    (lambda: fp8_from_flags("hybrid", "rowwise", False), "is torchao's (torchtitan)"),
    (lambda: model_from_dict({**model_to_dict(load_model("llama3-8b")), "compiled": True}), "compiled true prices"),
    (lambda: model_from_dict({**model_to_dict(load_model("llama3-8b")),
                              "fp8": {"recipe": "rowwise", "engine": "torchao"}}), "torchtitan's float8 converter"),
    (lambda: _ao(TW).flags(), "plan with --fp8-format / --fp8-recipe for Megatron-Core"),
])
def test_refusals_name_the_setting(make: object, says: str) -> None:
    with pytest.raises(SpecError) as e:
        make()  # type: ignore[operator]
    assert says in str(e.value)


def _lynx(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lynx", *args], capture_output=True, text=True, timeout=300)


def test_cli_plans_a_float8_compiled_layout_and_refuses_what_does_not_run(tmp_path: object) -> None:
    base = ["--model", "torchtitan-llama3-8b", "--hardware", "h100-80g-nvlink", "--seq-len", "4096",
            "--global-batch", "8"]
    plan = f"{tmp_path}/p.json"
    r = _lynx("plan", *base, "--tp", "1", "--pp", "1", "--dp", "8", "--micro-batch", "1", "--distributed-optimizer",
              "--compile", "--method", "mc-mlp",
              "--float8-recipe", "rowwise", "--out", plan)
    assert r.returncode == 0, r.stderr
    assert "torchao Float8 rowwise" in r.stdout
    for args, says in (
        (["export", "torchtitan", plan, "--out", f"{tmp_path}/t"], "keep some ops and recompute others"),
        (["export", "megatron", plan, "--out", f"{tmp_path}/m"], "runs TransformerEngine's FP8"),
        (["plan", *base, "--gpus", "8", "--float8-recipe", "tensorwise"], "use --target torchtitan"),
        (["plan", *base, "--gpus", "8", "--compile", "--target", "lynx"], "use --target torchtitan"),
        (["plan", *base, "--gpus", "8", "--float8-recipe", "rowwise", "--target", "torchtitan", "--method", "lynx"],
         "valid: none, full"),
        (["plan", *base, "--tp", "1", "--pp", "1", "--dp", "8", "--micro-batch", "1", "--float8-recipe", "rowwise",
          "--fp8-format", "hybrid"], "give one"),
    ):
        r = _lynx(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], r.stderr


def test_the_torchtitan_search_plans_whole_float8_blocks_and_its_pick_exports(tmp_path: object) -> None:
    out = f"{tmp_path}/pick.json"
    r = _lynx("plan", "--model", "torchtitan-llama3-8b", "--hardware", "h100-80g-nvlink", "--gpus", "8",
              "--global-batch", "16", "--seq-len", "8192", "--float8-recipe", "rowwise", "--compile", "--target",
              "torchtitan", "--json", "--out", out)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert {c["method"] for c in res["candidates"]} <= {"none", "full"}
    assert res["winner"]["priced_for"] == "torchtitan"
    e = _lynx("export", "torchtitan", out, "--out", f"{tmp_path}/tt")
    assert e.returncode == 0, e.stderr
    registry = Path(f"{tmp_path}/tt/lynx_torchtitan_registry.py").read_text()
    assert "FLOAT8: dict[str, Any] | None = {'recipe_name': 'rowwise', 'filter_fqns': ['lm_head']}" in registry


def test_titan_sac_keeps_what_torchtitans_policy_saves() -> None:
    """torchtitan's SelectiveAC: every other aten.mm (qkv, gate, down of 0.3.0's block), the attention and the SP
    reduce-scatters; Float8's _scaled_mm all (0.3.0) or none (its 2024-2025 save list)."""
    from lynx.policy.rules import titan_sac_keep

    g = build_layer_graph(_titan(compiled=False), H100, _par(tp=2, sp=True))
    base = {"core_attn", "attn_reducescatter", "mlp_reducescatter"}
    assert titan_sac_keep(g) == {"qkv", "gate", "down"} | base
    assert titan_sac_keep(g, "all") == {"qkv", "attn_proj", "gate", "up", "down"} | base
    assert titan_sac_keep(g, "none") == base
    assert titan_sac_keep(build_layer_graph(_titan(compiled=False), H100, _par())) == {"qkv", "gate", "down",
                                                                                       "core_attn"}


def test_titan_sac_is_a_method_compared_for_torchtitan_models_and_exported_whole(tmp_path: object) -> None:
    from lynx.api import compare_methods, make_problem
    from lynx.api import plan as plan_with
    from lynx.export.source import source_from
    from lynx.export.torchtitan import build_torchtitan
    from lynx.problem import PlanOptions

    par = ParallelSpec(tp=1, pp=1, dp=8, micro_batch_size=2, global_batch_size=16, seq_length=8192)
    opts = PlanOptions(precision="megatron-bf16", distributed_optimizer=True)
    titan = make_problem(_titan(compiled=False), H100, par, opts)
    assert "titan-sac" in compare_methods(titan)
    llama = make_problem(load_model("llama3-8b"), H100, par, opts)
    assert "titan-sac" not in compare_methods(llama)
    with pytest.raises(SpecError, match="torchtitan-llama3"):
        plan_with(llama, "titan-sac", record=False)
    res = plan_with(titan, "titan-sac", record=False)
    exp = build_torchtitan(source_from(titan, res.result))
    # the AC module keeps qkv's output though no backward reads it: torch's SAC starts the recomputation there
    assert {tuple(e["keep"]) for e in exp.ac_table["layers"]} == {("qkv", "core_attn", "gate", "down")}
    assert exp.figures[1].iteration_time_s == pytest.approx(exp.figures[0].iteration_time_s, rel=2e-3)
