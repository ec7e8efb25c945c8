"""The model-family seam and the LLaMA family: activation bytes in the style of Korthikanti et al.'s Table 2
(docs/costmodel.md derives them), flash attention, parameter counts against the published models, and the
specs' validation."""

from __future__ import annotations

import pytest

from lynx.cost.kernels import KernelCurves
from lynx.cost.layer import CostParams, build_layer_graph
from lynx.cost.memory import layer_memory
from lynx.errors import SpecError
from lynx.graph import LayerGraph
from lynx.models import check_model, layer_params, load_model, total_params, validate_layout
from lynx.policy.megatron_modules import modules_layer, parse_modules
from lynx.policy.rules import full_layer, keep_all, selective_layer
from lynx.spec import ModelSpec, ParallelSpec, load_hardware

SHAPES = [  # (model, tp, micro-batch, seq)
    ("llama3-8b", 1, 1, 4096), ("llama3-8b", 2, 2, 8192), ("llama3-70b", 8, 1, 4096), ("llama2-7b", 4, 4, 4096),
    ("llama2-70b", 8, 2, 4096), ("mistral-7b", 2, 1, 2048), ("llama3.1-405b", 8, 1, 8192),
]


def _graph(model: str, tp: int, mb: int, seq: int, sp: bool = False, **over: object) -> tuple[LayerGraph, ModelSpec]:
    from dataclasses import replace

    m = replace(load_model(model), **over)  # type: ignore[arg-type]
    par = ParallelSpec(tp=tp, micro_batch_size=mb, global_batch_size=mb, seq_length=seq, sequence_parallel=sp)
    return build_layer_graph(m, load_hardware("h100-80g-nvlink"), par), m


def _sbh(m: ModelSpec, mb: int, seq: int) -> tuple[float, float, float, float, float, float]:
    return seq * mb * m.hidden_size, m.num_query_groups / m.num_attention_heads, \
        m.ffn_hidden_size / m.hidden_size, float(seq * mb * m.num_attention_heads), float(seq), float(mb)


@pytest.mark.parametrize(("model", "tp", "mb", "seq"), SHAPES)
def test_llama_no_recompute_bytes(model: str, tp: int, mb: int, seq: int) -> None:
    g, m = _graph(model, tp, mb, seq)
    sbh, r, f, sba, _, _ = _sbh(m, mb, seq)
    # TP: sbh (8 + (6 + 6 g/a + 6 f/h) / t) + 4 sba / t (fp32 log-sum-exp); t = 1: sbh (14 + 6g/a + 6f/h) + 4sba.
    expected = sbh * (8 + (6 + 6 * r + 6 * f) / tp) + 4 * sba / tp
    assert g.retained_bytes(keep_all(g).keep) == pytest.approx(expected, rel=1e-12)
    # Full recomputation keeps the input only; core_attn (selective) with flash attention keeps every output
    # (the projection holds the attention output) and re-runs the kernel, freeing its log-sum-exp.
    assert g.retained_bytes(full_layer(g).keep) == pytest.approx(2 * sbh, rel=1e-12)
    assert selective_layer(g).keep == keep_all(g).keep and not selective_layer(g).recompute
    assert selective_layer(g).rerun == {"core_attn"}
    assert layer_memory(g, selective_layer(g)).retained == pytest.approx(expected - 4 * sba / tp, rel=1e-12)


@pytest.mark.parametrize(("model", "tp", "mb", "seq"), SHAPES)
def test_llama_sequence_parallel_bytes(model: str, tp: int, mb: int, seq: int) -> None:
    g, m = _graph(model, tp, mb, seq, sp=True)
    sbh, r, f, sba, _, _ = _sbh(m, mb, seq)
    assert g.retained_bytes(keep_all(g).keep) == pytest.approx((sbh * (14 + 6 * r + 6 * f) + 4 * sba) / tp,
                                                               rel=1e-12)
    assert g.retained_bytes(full_layer(g).keep) == pytest.approx(2 * sbh / tp, rel=1e-12)


@pytest.mark.parametrize(("model", "tp", "mb", "seq"), SHAPES[:4])
def test_megatron_modules_bytes(model: str, tp: int, mb: int, seq: int) -> None:
    g, m = _graph(model, tp, mb, seq)
    sbh, r, f, sba, _, _ = _sbh(m, mb, seq)
    none = g.retained_bytes(keep_all(g).keep)
    mlp = modules_layer(g, ("mlp",))
    assert g.retained_bytes(mlp.keep) == pytest.approx(none - 6 * f * sbh / tp, rel=1e-12)
    assert set(mlp.recomputed()) == {"gate_up", "swiglu"} and "rmsnorm2" in mlp.keep
    ln = modules_layer(g, ("layernorm",))
    assert g.retained_bytes(ln.keep) == pytest.approx(none - 4 * sbh, rel=1e-12)
    assert set(ln.recomputed()) == {"rmsnorm1", "rmsnorm2"}
    assert modules_layer(g, ("core_attn",)).keep == keep_all(g).keep  # the projection holds its output


def test_standard_attention_llama_stores_the_probabilities() -> None:
    fl, m = _graph("llama3-8b", 2, 1, 4096)
    st, _ = _graph("llama3-8b", 2, 1, 4096, attention="standard")
    s, b, a, t = 4096, 1, m.num_attention_heads, 2
    diff = st.retained_bytes(keep_all(st).keep) - fl.retained_bytes(keep_all(fl).keep)
    assert diff == pytest.approx(2 * a * s * s * b / t - 4 * s * b * a / t, rel=1e-12)  # + softmax - LSE
    # ... which selective (core_attn) recomputation frees again.
    assert st.retained_bytes(selective_layer(st).keep) == pytest.approx(
        fl.retained_bytes(keep_all(fl).keep) - 4 * s * b * a / t, rel=1e-12)


def test_flash_attention_pricing() -> None:
    g, m = _graph("llama3-8b", 2, 2, 4096)
    op = g.op("core_attn")
    a_l, d, s, b = m.num_attention_heads / 2, m.head_dim, 4096, 2
    assert op.fwd_flops == pytest.approx(2 * b * a_l * s * s * d)  # 4 b a s^2 d, halved by the causal mask
    # FlashAttention-2's 2.5x the forward's FLOPs, at the backward's own (lower) kernel efficiency (lynx.cost.kernels)
    curves = KernelCurves.of(load_hardware("h100-80g-nvlink").device)
    ko = CostParams.for_hardware(load_hardware("h100-80g-nvlink")).kernel_overhead_s
    ratio = curves.flash(s, d, backward=False) / curves.flash(s, d, backward=True)
    assert curves.flash(s, d, backward=True) < curves.flash(s, d, backward=False)
    assert (op.bwd_time - ko) == pytest.approx(2.5 * ratio * (op.fwd_time - ko))
    assert op.mask_bytes == pytest.approx(4 * b * a_l * s) and op.wgrad_time == 0
    assert set(op.saved) == {"rope", "qkv", "core_attn"}
    gpt, _ = _graph("gpt-7b", 2, 2, 2048, attention="flash")
    assert "core_attn" in gpt.names and "softmax" not in gpt.names


def test_gpt_selective_is_megatron_core_attn_and_flash_frees_only_the_lse() -> None:
    g, _ = _graph("gpt-7b", 4, 1, 2048)
    assert modules_layer(g, ("core_attn",)) == selective_layer(g)
    assert set(modules_layer(g, ("layernorm",)).recomputed()) == {"ln1", "ln2"}
    assert set(modules_layer(g, ("mlp",)).recomputed()) == {"fc1", "gelu"}
    gf, _ = _graph("gpt-7b", 4, 1, 2048, attention="flash")
    saved_std = layer_memory(g, keep_all(g)).retained - layer_memory(g, selective_layer(g)).retained
    saved_flash = layer_memory(gf, keep_all(gf)).retained - layer_memory(gf, selective_layer(gf)).retained
    assert saved_std > 0.5 * g.retained_bytes(keep_all(g).keep)
    assert saved_flash == pytest.approx(gf.op("core_attn").mask_bytes)  # the LSE; the kernel is re-run
    assert selective_layer(g).rerun == frozenset() and selective_layer(gf).rerun == {"core_attn"}


def test_parse_modules() -> None:
    assert parse_modules("mlp core_attn") == ("core_attn", "mlp")
    with pytest.raises(ValueError, match="choose from"):
        parse_modules("moe_layer")  # "moe" is Megatron's MoE module since decision 0222


@pytest.mark.parametrize(("model", "params"), [
    ("llama3-8b", 8_030_261_248), ("llama2-7b", 6_738_415_616), ("llama2-13b", 13_015_864_320),
    ("llama2-70b", 68_976_648_192), ("llama3-70b", 70_553_706_496), ("mistral-7b", 7_248_023_552),
])
def test_parameter_counts_match_the_published_models(model: str, params: int) -> None:
    assert total_params(load_model(model)) == params


def test_untied_head_on_the_last_stage() -> None:
    from lynx.cost.static_memory import stage_params

    def static_bytes(m: object, par: ParallelSpec, stage: int, n: int, _per_param: float) -> float:
        return stage_params(m, par, stage, n).total  # type: ignore[arg-type]

    m = load_model("llama3-8b")
    par = ParallelSpec(tp=2, pp=1, seq_length=4096)
    layers = 32 * ((layer_params(m) - 2 * m.hidden_size) / 2 + 2 * m.hidden_size)  # RMSNorms replicated
    emb = m.vocab_size * m.hidden_size / 2
    assert static_bytes(m, par, 0, 32, 1.0) == pytest.approx(layers + 2 * emb + m.hidden_size)
    par4 = ParallelSpec(tp=2, pp=4, seq_length=4096)
    assert static_bytes(m, par4, 1, 8, 1.0) == pytest.approx(layers / 4)


def test_validation_errors() -> None:
    hw = load_hardware("h100-80g-nvlink")
    m = load_model("llama3-8b")
    with pytest.raises(SpecError, match="query groups"):  # 32 heads split over 16, 8 K/V heads not
        validate_layout(m, hw, ParallelSpec(tp=16), nodes=8)
    validate_layout(m, hw, ParallelSpec(tp=8))
    with pytest.raises(SpecError, match="not divisible by num_query_groups"):
        ModelSpec("x", 2, 64, 8, num_query_groups=3, family="llama", activation="swiglu", normalization="rmsnorm",
                  position_embedding="rope")
    # the family's own rules: checked where a model meets its family (loading, and every problem's layout check)
    with pytest.raises(SpecError, match="family llama has activation swiglu"):
        check_model(ModelSpec("x", 2, 64, 8, family="llama"))
    with pytest.raises(SpecError, match="family gpt has no grouped-query"):
        validate_layout(ModelSpec("x", 2, 64, 8, num_query_groups=2), hw, ParallelSpec(tp=1))
    with pytest.raises(SpecError, match="unknown model family"):
        check_model(ModelSpec("x", 2, 64, 8, family="mamba"))
    with pytest.raises(SpecError, match="attention must be one of standard, flash"):
        ModelSpec("x", 2, 64, 8, attention="fast")  # type: ignore[arg-type]


def test_family_defaults_from_a_model_file(tmp_path) -> None:
    p = tmp_path / "tiny-llama.yaml"
    p.write_text("family: llama\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 8\nnum_query_groups: 2\n")
    m = load_model(str(p))
    assert (m.activation, m.normalization, m.position_embedding, m.attention, m.tie_embeddings, m.dropout) == \
        ("swiglu", "rmsnorm", "rope", "flash", False, False)
    from lynx.models import model_from_dict
    from lynx.spec import model_to_dict

    assert model_from_dict(model_to_dict(m)) == m


def test_heu_and_simulation_plan_llama_unchanged() -> None:
    from lynx.api import compare, make_problem
    from lynx.methods import available_methods
    from lynx.problem import PlanOptions

    if "lynx-heu" not in available_methods():
        pytest.skip("lynx-heu not registered")
    m, hw = load_model("llama3-8b"), load_hardware("a100-40g-nvlink")
    par = ParallelSpec(tp=4, pp=2, micro_batch_size=2, global_batch_size=32, seq_length=8192)
    prob = make_problem(m, hw, par, PlanOptions())
    rows = {r.method: r for r in compare(prob, ["none", "full", "selective", "mc-mlp", "lynx-heu", "lynx"])}
    for name in ("full", "mc-mlp", "lynx-heu", "lynx"):
        p = rows[name].plan
        assert p is not None and not p.sim.oom, name
    assert rows["none"].plan.sim.oom and rows["selective"].plan.sim.oom  # type: ignore[union-attr]
    t = {k: r.plan.sim.iteration_time_s for k, r in rows.items() if r.plan is not None}  # type: ignore[union-attr]
    assert t["lynx"] <= t["mc-mlp"] < t["full"]
