"""lynx's priced bytes for torchtitan's kernels (family torchtitan-llama3) against what torchtitan's own Llama 3
block keeps for backward, measured with saved_tensors_hooks on CPU (each storage counted once). The CPU build runs
``nn.RMSNorm`` as the eager fp32 composite, so the measured model is planned with ``norm_fusion: false``; on CUDA
torch runs ``_fused_rms_norm`` (the family's default), which keeps its 16-bit input instead."""

from __future__ import annotations

import pytest

from lynx.cost.layer import build_layer_graph
from lynx.models import layer_params, load_model
from lynx.spec import ModelSpec, ParallelSpec, load_hardware


def _model(family: str, n_kv: int, norm_fusion: bool = True) -> ModelSpec:
    import dataclasses

    m = load_model("llama-tiny")
    return dataclasses.replace(m, name="titan-debug", family=family, num_layers=6, hidden_size=256,
                               num_attention_heads=16, num_query_groups=n_kv, ffn_hidden_size=768, vocab_size=2048,
                               norm_fusion=norm_fusion)


@pytest.mark.parametrize(("n_kv", "mb", "seq"), [(16, 1, 128), (4, 2, 64)])
def test_priced_bytes_per_op_equal_torchtitans_measured(n_kv: int, mb: int, seq: int) -> None:
    pytest.importorskip("torchtitan")
    import torch

    from lynx.integrations.torchtitan.measure import saved_bytes_by_op
    from tests.harness.torchtitan_models import debug_model

    block = debug_model(1, None if n_kv == 16 else n_kv).layers["0"]
    for p in block.parameters():  # bf16 compute, as torchtitan's FSDP mixed precision runs the block
        p.data = p.data.to(torch.bfloat16)
    x = torch.randn(mb, seq, 256, dtype=torch.bfloat16, requires_grad=True)
    measured = saved_bytes_by_op(block, x, None, None)

    par = ParallelSpec(micro_batch_size=mb, global_batch_size=mb, seq_length=seq)
    g = build_layer_graph(_model("torchtitan-llama3", n_kv, norm_fusion=False), load_hardware("h100-80g-nvlink"), par)
    priced = {n: g.keep_bytes(n) for n in g.needed()}
    assert "input" not in measured  # an eager block does not keep its input; lynx keeps it as the checkpoint
    assert measured == pytest.approx(priced, abs=0.5)
    assert g.retained_bytes(g.needed()) == sum(measured.values()) + g.input_bytes

    # Megatron's kernels (family llama) keep less: the plan must be priced for the kernels that run it.
    mg = build_layer_graph(_model("llama", n_kv), load_hardware("h100-80g-nvlink"), par)
    assert mg.retained_bytes(mg.needed()) < 0.8 * g.retained_bytes(g.needed())


def test_titan_family_prices_a_llama3_8b_layer_half_again_above_megatron() -> None:
    """Llama-3-8B, bf16, TP 1, micro-batch 1, sequence 1024: 146 MiB with Megatron's fused kernels. torchtitan's
    eager block on CPU keeps about 1.5x that (the per-op bytes measured above, at 8B's shapes: the eager RMSNorm's
    fp32 state, 8h + 4 per token each, and the unfused SwiGLU's four [tokens, f] tensors): `norm_fusion` False.
    On CUDA torch runs RMSNorm fused (``_fused_rms_norm``: it keeps its 16-bit input, the family's default), and the
    block keeps about 1.12x Megatron's: the SwiGLU's extra [tokens, f] tensors and RoPE's copies."""
    import dataclasses

    hw, par = load_hardware("h100-80g-nvlink"), ParallelSpec(micro_batch_size=1, global_batch_size=1, seq_length=1024)
    m = load_model("llama3-8b")
    mega = build_layer_graph(m, hw, par)
    mega_bytes = mega.retained_bytes(mega.needed())
    eager = build_layer_graph(dataclasses.replace(m, family="torchtitan-llama3", norm_fusion=False), hw, par)
    assert mega_bytes / 2**20 == pytest.approx(146.1, abs=0.1)
    assert 1.45 < eager.retained_bytes(eager.needed()) / mega_bytes < 1.55
    titan = build_layer_graph(dataclasses.replace(m, family="torchtitan-llama3"), hw, par)
    assert 1.10 < titan.retained_bytes(titan.needed()) / mega_bytes < 1.15
    assert titan.op("rmsnorm2").saved == ("attn_residual",) and eager.op("rmsnorm2").saved == ("rmsnorm2",)
    assert {o.name for o in titan.ops} >= {"rmsnorm1", "v_copy", "gate", "up", "silu", "swiglu", "down"}
    # parameters are LLaMA's: the same model, other kernels
    assert layer_params(m) == layer_params(dataclasses.replace(m, family="torchtitan-llama3"))


def test_titan_family_with_sequence_parallelism_keeps_the_gathered_gemm_input() -> None:
    import dataclasses

    hw = load_hardware("h100-80g-nvlink")
    m = dataclasses.replace(load_model("llama3-8b"), family="torchtitan-llama3")
    par = ParallelSpec(tp=4, micro_batch_size=1, global_batch_size=1, seq_length=1024, sequence_parallel=True)
    g = build_layer_graph(m, hw, par)
    assert g.op("qkv").saved == ("attn_allgather",) and "attn_allgather" in g.needed()
    assert g.keep_bytes("attn_allgather") == 2 * 1024 * 4096
