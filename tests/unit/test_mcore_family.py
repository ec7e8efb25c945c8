"""family mcore: Megatron-Core's switches as independent fields. With LLaMA's switches it is the llama layer,
with GPT's the gpt layer (same ops, bytes, times and parameters); other combinations (Nemotron-4, Qwen2.5) plan."""

from __future__ import annotations

import dataclasses

import pytest

from lynx.api import make_problem, plan
from lynx.cost.layer import build_layer_graph
from lynx.errors import SpecError
from lynx.models import check_model, layer_params, load_model, total_params
from lynx.policy.rules import keep_all
from lynx.problem import PlanOptions
from lynx.spec import ModelSpec, ParallelSpec, load_hardware


def _par(tp: int, sp: bool, mb: int = 2, seq: int = 2048) -> ParallelSpec:
    return ParallelSpec(tp=tp, sequence_parallel=sp, micro_batch_size=mb, global_batch_size=mb, seq_length=seq)


def _as_mcore(m: ModelSpec) -> ModelSpec:
    return dataclasses.replace(m, family="mcore")


@pytest.mark.parametrize("name", ["llama3-8b", "gpt-7b"])
@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (4, True)])
def test_mcore_with_a_familys_switches_is_that_family(name: str, tp: int, sp: bool) -> None:
    m = load_model(name)
    if name == "gpt-7b":
        m = dataclasses.replace(m, attention="flash")
    hw = load_hardware("h100-80g-nvlink")
    a, b = build_layer_graph(m, hw, _par(tp, sp)), build_layer_graph(_as_mcore(m), hw, _par(tp, sp))
    assert a.names == b.names
    assert a.retained_bytes(keep_all(a).keep) == pytest.approx(b.retained_bytes(keep_all(b).keep), rel=1e-12)
    assert a.fwd_time() == pytest.approx(b.fwd_time(), rel=1e-12)
    assert a.bwd_time() == pytest.approx(b.bwd_time(), rel=1e-12)
    assert total_params(m) == total_params(_as_mcore(m))


def test_squared_relu_and_biases_change_what_they_should() -> None:
    base = load_model("nemotron4-15b")
    hw, par = load_hardware("h100-80g-nvlink"), _par(8, True)
    gelu = dataclasses.replace(base, activation="gelu")
    g_sq, g_ge = build_layer_graph(base, hw, par), build_layer_graph(gelu, hw, par)
    assert g_sq.op("squared_relu").fwd_flops < g_ge.op("gelu").fwd_flops
    assert g_sq.retained_bytes(keep_all(g_sq).keep) == g_ge.retained_bytes(keep_all(g_ge).keep)
    h, a, g, d, f = base.hidden_size, 48, 8, base.head_dim, base.ffn_hidden_size
    with_bias = layer_params(dataclasses.replace(base, bias="all")) - layer_params(base)
    assert with_bias == (a + 2 * g) * d + f + 2 * h      # QKV, FC1, proj and FC2 biases
    qkv = layer_params(dataclasses.replace(base, bias="qkv")) - layer_params(base)
    assert qkv == (a + 2 * g) * d


@pytest.mark.parametrize(("name", "billions"), [("nemotron4-15b", 15.6), ("nemotron4-340b", 341.0),
                                                ("qwen2.5-7b", 7.62), ("qwen2.5-72b", 72.7)])
def test_presets_have_their_published_size_and_plan(name: str, billions: float) -> None:
    m = load_model(name)
    assert total_params(m) / 1e9 == pytest.approx(billions, rel=0.01)
    if billions > 100:
        return
    tp = 4 if name == "qwen2.5-7b" else 8
    pp = 4 if name == "qwen2.5-72b" else 2
    par = ParallelSpec(tp=tp, pp=pp, sequence_parallel=True, micro_batch_size=1, global_batch_size=8,
                       seq_length=4096)
    p = plan(make_problem(m, load_hardware("h100-80g-nvlink"), par,
                          PlanOptions(precision="megatron-bf16", tp_comm_overlap=True)), "lynx", record=False)
    assert p.sim.iteration_time_s > 0 and not p.sim.oom


def test_fixed_families_point_to_mcore() -> None:
    """A model changed in code is checked against its family where it meets it (`lynx.models.check_model`)."""
    with pytest.raises(SpecError, match="family mcore"):
        check_model(dataclasses.replace(load_model("gpt-7b"), activation="squared-relu"))
    with pytest.raises(SpecError, match="mcore"):
        check_model(dataclasses.replace(load_model("gpt-7b"), num_query_groups=8))
    with pytest.raises(SpecError, match="family mcore"):
        check_model(dataclasses.replace(load_model("llama3-8b"), bias="qkv"))
