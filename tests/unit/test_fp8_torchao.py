"""torchao's own saved-tensor accounting beside lynx's TransformerEngine rule (runs where torchao imports).

torchao's Float8Linear (torchao/float8/float8_linear.py, `matmul_with_hp_or_float8_args.forward`:
``ctx.save_for_backward(input_hp, weight_hp_t)``) keeps the *16-bit* input and re-quantizes it in backward;
TransformerEngine keeps the FP8 copy (1 byte). So lynx prices the two apart: TE's graph keeps the FP8 copy, the
torchao graph (`Fp8.engine` torchao, `lynx.cost.float8_torchao`, decision 0268) keeps what the 16-bit graph keeps.
This test counts what torchao saves on the CPU (torch's CPU _scaled_mm) with autograd's saved-tensor hooks, and
fails if torchao's rule changes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lynx.cost.layer import build_layer_graph
from lynx.fp8 import Fp8, Fp8Engine, Fp8Recipe
from lynx.models import load_model
from lynx.spec import ParallelSpec, load_hardware

float8 = pytest.importorskip("torchao.float8")  # first: without torchao the test skips before torch loads
torch = pytest.importorskip("torch")


def _saved_bytes(tokens: int, k: int, n: int) -> list[int]:
    lin = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(torch.bfloat16)
    float8.convert_to_float8_training(lin)
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.element_size() * t.numel())
        return t

    x = torch.randn(tokens, k, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lin(x)
    return sizes


def test_torchao_keeps_the_16_bit_input_where_transformer_engine_keeps_fp8() -> None:
    tokens, k, n = 64, 256, 512
    sizes = _saved_bytes(tokens, k, n)
    assert sorted(sizes) == sorted([2 * tokens * k, 2 * k * n])  # 16-bit input and 16-bit weight
    # lynx (TransformerEngine's rule) keeps one byte per input element for the same kind of GEMM
    par = ParallelSpec(tp=1, pp=1, dp=1, micro_batch_size=1, global_batch_size=1, seq_length=tokens)
    m = replace(load_model("llama-tiny"), fp8=Fp8())
    g = build_layer_graph(m, load_hardware("h100-80g-nvlink"), par)
    down = g.op("down_fp8")
    assert down.out_bytes == tokens * m.ffn_hidden_size * 1.0


def test_lynx_torchao_graph_keeps_what_torchao_keeps() -> None:
    tokens, k, n = 64, 256, 512
    sizes = _saved_bytes(tokens, k, n)
    assert 2 * tokens * k in sizes  # the 16-bit input, as lynx's torchao rewrite keeps it
    par = ParallelSpec(tp=1, pp=1, dp=1, micro_batch_size=1, global_batch_size=1, seq_length=tokens)
    hw = load_hardware("h100-80g-nvlink")
    m = load_model("torchtitan-llama3-8b")
    ao = replace(m, fp8=Fp8(recipe=Fp8Recipe.ROWWISE, engine=Fp8Engine.TORCHAO))
    down, down_ao = build_layer_graph(m, hw, par).op("down"), build_layer_graph(ao, hw, par).op("down")
    assert down_ao.saved == down.saved == ("swiglu",)
