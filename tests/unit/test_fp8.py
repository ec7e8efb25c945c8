"""FP8 linear layers priced as TransformerEngine runs them (lynx.cost.fp8, lynx.cost.fp8_memory).

The expected figures are written out from TransformerEngine's rules (module/linear.py `_Linear.forward`: the
input is quantized and only its FP8 copy is kept for backward, one byte per element, the local shard when the
input is all-gathered; weights cached in FP8 row-wise and transposed), not read off lynx's own graph."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lynx.cost.collectives import gather_time
from lynx.cost.dp_overlap import dp_sync
from lynx.cost.fp8_memory import fp8_weight_elements
from lynx.cost.kernels import KernelCurves
from lynx.cost.layer import build_layer_graph
from lynx.cost.static_memory import recipe_for, stage_static
from lynx.errors import SpecError
from lynx.fp8 import Fp8, Fp8Format, Fp8Recipe, fp8_from_flags
from lynx.graph import LayerGraph
from lynx.models import check_fp8, load_model, validate_layout
from lynx.spec import ModelSpec, ParallelSpec, load_hardware

H100 = load_hardware("h100-80g-nvlink")
DELAYED = Fp8(Fp8Format.HYBRID, Fp8Recipe.DELAYED)


def _llama(fp8: Fp8 | None) -> ModelSpec:
    return replace(load_model("llama3-8b"), fp8=fp8)


def _par(sp: bool, tp: int = 2) -> ParallelSpec:
    return ParallelSpec(tp=tp, pp=1, dp=1, sequence_parallel=sp, micro_batch_size=1, global_batch_size=8,
                        seq_length=4096)


def _kept(g: LayerGraph) -> float:
    """Bytes one layer keeps for backward with nothing recomputed (the input and every op some backward reads)."""
    return g.retained_bytes(g.needed())


@pytest.mark.parametrize("sp", [False, True])
def test_an_fp8_layer_keeps_the_bytes_transformer_engine_keeps(sp: bool) -> None:
    m, par = _llama(None), _par(sp)
    t, tok, h, f = par.tp, 4096.0, m.hidden_size, m.ffn_hidden_size
    bf16, fp8 = build_layer_graph(m, H100, par), build_layer_graph(_llama(DELAYED), H100, par)
    rows = tok / t if sp else tok  # the norms' outputs: sharded with SP
    # QKV and FC1 (gate/up) keep an FP8 copy of their norm's output instead of the 16-bit one (2 -> 1 byte);
    # the projection keeps an FP8 copy of the attention output beside the 16-bit one attention keeps for its own
    # backward (+1 byte); down keeps FP8 SwiGLU output instead of 16-bit (2 -> 1)
    expect = _kept(bf16) - 2 * rows * h + tok * h / t - tok * f / t
    assert _kept(fp8) == pytest.approx(expect, rel=1e-12)
    assert fp8.op("qkv").saved == ("qkv_fp8",) and fp8.op("qkv_fp8").out_bytes == rows * h


def test_blockwise_keeps_its_fp32_scales_per_128_elements() -> None:
    par = _par(False)
    g = build_layer_graph(_llama(Fp8(recipe=Fp8Recipe.BLOCKWISE)), H100, par)
    assert g.op("down_fp8").out_bytes == pytest.approx(4096 * 14336 / 2 * (1 + 4 / 128))


def test_fp8_gemms_run_at_the_fp8_peak_and_attention_stays_16_bit() -> None:
    par = _par(False)
    bf16, fp8 = build_layer_graph(_llama(None), H100, par), build_layer_graph(_llama(DELAYED), H100, par)
    q16, q8 = bf16.op("gate_up"), fp8.op("gate_up")
    # same shape at the FP8 peak (the datasheet's 2 x BF16) and the FP8 curve's efficiency
    d = H100.device
    assert d.fp8_peak_flops is not None and d.fp8_peak_flops / d.peak_flops == pytest.approx(2.0, rel=1e-3)
    mnk = (4096.0, 4096.0, 2 * 14336 / 2)
    eff = KernelCurves.fp8_of(d).gemm(*mnk)
    assert q8.fwd_time == pytest.approx(4e-6 + 2 * 4096 * 4096 * 14336 / (d.fp8_peak_flops * eff))
    assert q8.fwd_time < q16.fwd_time
    assert q8.fwd_flops == q16.fwd_flops and q8.bwd_time == pytest.approx(2 * q8.fwd_time)
    assert fp8.op("core_attn").fwd_time == bf16.op("core_attn").fwd_time
    assert fp8.op("swiglu").fwd_time == bf16.op("swiglu").fwd_time
    # the quantize ops are memory-bound passes: read 2, write row-wise and transposed copies (delayed: one kernel)
    cast = fp8.op("down_fp8")
    elems = 4096 * 14336 / 2
    bw = d.memory_bandwidth_Bps * d.memory_efficiency
    assert cast.fwd_time == pytest.approx(4e-6 + elems * (2 + 1 + 1) / bw)


def test_tensorwise_adds_an_amax_pass() -> None:
    par = _par(False)
    dl = build_layer_graph(_llama(DELAYED), H100, par).op("down_fp8")
    tw = build_layer_graph(_llama(Fp8(recipe=Fp8Recipe.TENSORWISE)), H100, par).op("down_fp8")
    d = H100.device
    elems = 4096 * 14336 / 2
    assert tw.fwd_time - dl.fwd_time == pytest.approx(4e-6 + 2 * elems / (d.memory_bandwidth_Bps * d.memory_efficiency))


def test_the_sequence_parallel_gather_moves_fp8_and_the_gradient_16_bit() -> None:
    par = _par(True, tp=4)
    g = build_layer_graph(_llama(DELAYED), H100, par)
    link = H100.link_for_group(4, 1)
    full = 4096 * 4096.0  # tokens x hidden, gathered
    ag = g.op("attn_allgather")
    assert ag.fwd_time == pytest.approx(gather_time(full * 1.0, 4, link))
    assert ag.bwd_time == pytest.approx(gather_time(full * 2.0, 4, link) + gather_time(full * 1.0, 4, link))
    assert g.op("attn_reducescatter").fwd_time == pytest.approx(gather_time(full * 2.0, 4, link))


def test_weight_copies_and_fp8_parameters_in_static_memory() -> None:
    par = _par(False)
    recipe = recipe_for("megatron-bf16")
    base = stage_static(_llama(None), par, 0, 4, recipe).param_bytes
    m = _llama(None)
    h, a, g, f, d = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size, m.head_dim
    weights = (h * (a + 2 * g) * d + a * d * h + 3 * h * f) / par.tp  # QKV, proj, gate/up, down per rank
    assert fp8_weight_elements(_llama(DELAYED), par) == weights
    cached = stage_static(_llama(DELAYED), par, 0, 4, recipe).param_bytes
    assert cached - base == pytest.approx(4 * weights * 2)  # row-wise + transposed FP8 copies
    fp8_params = stage_static(_llama(Fp8(param_gather=True)), par, 0, 4, recipe).param_bytes
    assert fp8_params == pytest.approx(base)  # 1 byte + its transpose in place of 2 bytes of BF16


def test_fp8_param_gather_moves_one_byte_per_gemm_weight() -> None:
    par = ParallelSpec(tp=2, pp=2, dp=4, micro_batch_size=1, global_batch_size=8, seq_length=4096)
    recipe, link = recipe_for("megatron-bf16"), H100.inter_node
    plain = dp_sync(_llama(DELAYED), par, 1, 16, recipe, link, True)
    fp8 = dp_sync(_llama(Fp8(param_gather=True)), par, 1, 16, recipe, link, True)
    assert fp8.grad_s == plain.grad_s and fp8.param_s < 0.6 * plain.param_s


def test_devices_and_recipes_lynx_cannot_price_are_refused() -> None:
    a100 = load_hardware("a100-80g-dgx")
    with pytest.raises(SpecError, match="no FP8 tensor cores"):
        validate_layout(_llama(DELAYED), a100, _par(False))
    with pytest.raises(SpecError, match="Blackwell"):
        check_fp8(_llama(Fp8(recipe=Fp8Recipe.MXFP8)), H100.device)
    with pytest.raises(SpecError, match="fp8_param must be used together"):
        fp8_from_flags(None, None, True, "x")
    with pytest.raises(SpecError, match="custom"):
        fp8_from_flags("hybrid", "custom", False, "x")
    with pytest.raises(SpecError, match="valid: hybrid, e4m3"):
        fp8_from_flags("e5m2", None, False, "x")
    assert fp8_from_flags("e4m3", None, False, "x") == Fp8(Fp8Format.E4M3, Fp8Recipe.DELAYED, False)
