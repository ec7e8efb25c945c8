"""lynx's profiler on the torchtitan integration's `TitanLayer`: which backward reads which op output
(`count_saved`, what `lynx.profile.profiler.assemble` puts in each op's `saved`).

TitanLayer runs torchtitan's block with the block's own weights and RoPE table, which are not its parameters or
buffers (it is not the block's parent); `count_saved` used to take them for activations, so every GEMM read
"its own output" (its weight) and rope kept an 8 MiB side state (the table), and a plan made from the profile
restored qkv and attn_proj in windows for no backward (decision 0088)."""

from __future__ import annotations

from typing import Any

import pytest

SEQ, MB = 64, 2


def _profile(dtype: Any) -> Any:
    import torch

    from lynx.integrations.torchtitan.layer import TitanLayer
    from lynx.profile.measure import count_saved
    from tests.harness.torchtitan_models import debug_model

    block = debug_model(1).layers["0"]
    for p in block.parameters():
        p.data = p.data.to(dtype)
    layer = TitanLayer(block, 0, None)
    x = torch.randn(MB, SEQ, 256, dtype=dtype, requires_grad=True)
    return layer, count_saved(layer, x)


def _family_reads() -> dict[str, tuple[str, ...]]:
    from lynx.profile.profiler import ProfileConfig, analytic_graph

    cfg = ProfileConfig(model="titan-debug", hidden_size=256, num_attention_heads=16, ffn_hidden_size=768,
                        seq_length=SEQ, micro_batch_size=MB, tp=1, dtype="bf16", family="torchtitan-llama3",
                        dropout_p=0.0, repeats=1, threads=1, num_query_groups=16)
    return {o.name: o.saved for o in analytic_graph(cfg).ops}


def test_bf16_profiled_reads_equal_the_family_graphs_op_by_op() -> None:
    pytest.importorskip("torchtitan")
    import torch

    layer, sv = _profile(torch.bfloat16)
    family = _family_reads()
    assert {n: set(sv.saved_by[n]) for n in layer.op_names} == {n: set(family[n]) for n in layer.op_names}
    for gemm in ("qkv", "attn_proj", "gate", "up", "down", "rope"):  # no weight, no RoPE table as side state
        assert sv.side_bytes[gemm] == 0, gemm


def test_fp32_norms_also_read_their_input_and_the_engine_restores_it() -> None:
    """In fp32 eager RMSNorm saves its input itself (bf16 saves an fp32 upcast copy, a side state): the profile
    says rmsnorm1 reads the layer input and rmsnorm2 attn_residual, every other op as the family says, and
    the engine agrees -- dropping attn_residual (everything else kept) restores it on demand in fp32, never
    in bf16."""
    pytest.importorskip("torchtitan")
    import torch

    from lynx.decisions import LayerPolicy
    from lynx.graph import LAYER_INPUT
    from lynx.integrations.torchtitan import apply_lynx_plan
    from tests.harness.torchtitan_models import debug_model

    layer, sv = _profile(torch.float32)
    family = _family_reads()
    extra = {"rmsnorm1": LAYER_INPUT, "rmsnorm2": "attn_residual"}
    for n in layer.op_names:
        assert set(sv.saved_by[n]) == set(family[n]) | ({extra[n]} if n in extra else set()), n

    restored = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = debug_model(2).to(dtype)
        keep = frozenset(layer.op_names) - {"attn_residual", "attn_allreduce", "mlp_allreduce", "mlp_residual"}
        lynx = apply_lynx_plan(model, dict.fromkeys(range(2), LayerPolicy(keep=keep, recompute=())))
        model(torch.randint(0, 2048, (1, SEQ))).float().sum().backward()
        restored[dtype] = lynx.stats.restored_on_demand
    assert restored[torch.float32] > 0 and restored[torch.bfloat16] == 0
