"""The runtime LLaMA layer speaks the family's op vocabulary, its hand-written backward passes are right,
and what autograd saves (saved-tensor hooks) is the graph's accounting, per op, within 2%; against
transformers' LlamaDecoderLayer (optional) the difference is exactly the documented implementation details."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from lynx.cost.layer import build_layer_graph  # noqa: E402
from lynx.graph import LAYER_INPUT  # noqa: E402
from lynx.policy.rules import keep_all  # noqa: E402
from lynx.profile.measure import count_saved  # noqa: E402
from lynx.profile.profiler import SAVED_TOLERANCE, expected_saved  # noqa: E402
from lynx.runtime.layers.llama import LlamaConfig, LlamaLayer, _RMSNorm, _Rope, _SwiGLU  # noqa: E402
from lynx.spec import ParallelSpec, load_hardware  # noqa: E402
from tests.harness.check import runtime_graph  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = LlamaConfig(hidden_size=128, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=224, seq_length=32,
                  micro_batch_size=2)


def _graph(cfg: LlamaConfig):  # type: ignore[no-untyped-def]
    par = ParallelSpec(tp=cfg.tp, sequence_parallel=cfg.sequence_parallel, seq_length=cfg.seq_length,
                       micro_batch_size=cfg.micro_batch_size, global_batch_size=cfg.micro_batch_size)
    g = build_layer_graph(cfg.model_spec(1, 64), load_hardware("h100-80g-nvlink"), par)
    return runtime_graph(g, cfg.dtype)


@pytest.mark.parametrize("sp", [False, True])
def test_vocabulary_and_saved_bytes_match_the_graph(sp: bool) -> None:
    cfg = replace(CFG, sequence_parallel=sp)
    layer, g = LlamaLayer(cfg), _graph(cfg)
    assert layer.op_names == g.names
    assert all(layer.op_inputs[o.name] == o.inputs for o in g.ops)
    x = torch.randn(cfg.seq_length, cfg.micro_batch_size, cfg.hidden_size, requires_grad=True)
    sv = count_saved(layer, x)
    expect = expected_saved(g)
    total_meas, total_exp = 0.0, 0.0
    for o in g.ops:
        held = sv.saved_output_bytes[o.name] if o.name != g.output_op else 0.0
        meas = held + sv.side_bytes[o.name]
        assert abs(meas - expect[o.name]) <= SAVED_TOLERANCE * max(expect[o.name], 1.0), (o.name, meas, expect[o.name])
        assert set(sv.saved_by[o.name]) - {o.name} == set(o.saved) - {o.name}, o.name
        total_meas += meas
        total_exp += expect[o.name]
    total_meas += sv.saved_output_bytes[LAYER_INPUT]
    total_exp += expect[LAYER_INPUT]
    assert total_exp == pytest.approx(g.retained_bytes(keep_all(g).keep))
    assert abs(total_meas - total_exp) <= 0.02 * total_exp
    # the only difference is RMSNorm's fp32 1/rms per token, which the graph folds away
    assert total_meas - total_exp == 2 * 4 * cfg.seq_length * cfg.micro_batch_size


def test_run_op_is_forward() -> None:
    layer = LlamaLayer(CFG, layer_index=2)
    x = torch.randn(32, 2, 128)
    env = {LAYER_INPUT: x}
    for n in layer.op_names:
        env[n] = layer.run_op(n, env)
    assert torch.equal(env["mlp_residual"], layer(x))
    with pytest.raises(KeyError):
        layer.run_op("softmax", env)


def test_custom_backwards_against_autograd() -> None:
    d = torch.float64
    x = torch.randn(4, 3, 16, dtype=d, requires_grad=True)
    w = torch.randn(16, dtype=d, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: _RMSNorm.apply(a, b, 1e-5), (x, w))
    assert torch.autograd.gradcheck(_SwiGLU.apply, (torch.randn(4, 3, 16, dtype=d, requires_grad=True),))
    s, b, g_l, per, hd = 5, 2, 2, 4, 6
    ang = torch.rand(s, 1, 1, hd, dtype=d)
    qkv = torch.randn(s, b, g_l * per * hd, dtype=d, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q: _Rope.apply(q, ang.cos(), ang.sin(), (s, b, g_l, per, hd)), (qkv,))


def test_attention_matches_a_plain_grouped_query_reference() -> None:
    """core_attn on the layer's views equals softmax(QK^T/sqrt(d) + causal) V with K/V repeated per group."""
    layer = LlamaLayer(CFG)
    x = torch.randn(32, 2, 128)
    env = {LAYER_INPUT: x}
    for n in ("rmsnorm1", "qkv", "rope"):
        env[n] = layer.run_op(n, env)
    out = layer.run_op("core_attn", env)
    s, b, a, g, d = 32, 2, 8, 2, 16
    q = env["rope"][:, :, :a].permute(1, 2, 0, 3)
    k = env["rope"][:, :, a:].permute(1, 2, 0, 3).repeat_interleave(a // g, 1)
    v = env["qkv"].view(s, b, g, a // g + 2, d)[:, :, :, -1].permute(1, 2, 0, 3).repeat_interleave(a // g, 1)
    scores = q @ k.transpose(-1, -2) / d ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ref = (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(s, b, a * d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_against_transformers_llama_decoder_layer() -> None:
    """A standard implementation saves the graph's bytes plus exactly what its implementation adds: separate
    q/k/v projections keep only V's storage (- (a+g) d per token), its fp32 RMSNorms keep the normalised
    input and 1/rms (+ h + 1 each), its rotary tables (+ 2 d), and its unfused SwiGLU keeps silu(gate) (+ f)."""
    tr = pytest.importorskip("transformers.models.llama.modeling_llama")
    h, a, g, f, s, b = CFG.hidden_size, CFG.num_attention_heads, 2, CFG.ffn_hidden_size, CFG.seq_length, 2
    hc = tr.LlamaConfig(hidden_size=h, num_attention_heads=a, num_key_value_heads=g, intermediate_size=f,
                        max_position_embeddings=s, attention_dropout=0.0)
    hc._attn_implementation = "sdpa"
    layer, rot = tr.LlamaDecoderLayer(hc, layer_idx=0), tr.LlamaRotaryEmbedding(hc)
    x = torch.randn(b, s, h, requires_grad=True)
    pos = torch.arange(s)[None].expand(b, s)
    cos_sin = rot(x, pos)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    held: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, attention_mask=None, position_embeddings=cos_sin, position_ids=pos)
    graph = _graph(CFG)
    ours = graph.retained_bytes(keep_all(graph).keep)
    d, tok = h // a, s * b
    extra = 4 * tok * (-(a + g) * d + 2 * (h + 1) + 2 * d + f)
    assert sum(held.values()) == pytest.approx(ours + extra, rel=0.02)


def test_profile_a_llama_layer() -> None:
    """`lynx profile` measures the family's runtime layer: the measured graph has the family's ops and its
    saved bytes agree with the analytic graph within 2% per op."""
    from lynx.profile.profiler import ProfileConfig, profile

    cfg = ProfileConfig(model="tiny-llama", hidden_size=128, num_attention_heads=8, ffn_hidden_size=224,
                        seq_length=32, micro_batch_size=2, dropout_p=0.0, warmup=0, repeats=1, threads=1,
                        family="llama", num_query_groups=2, device="cpu")
    res = profile(cfg)
    assert res.graph.names == _graph(CFG).names and res.graph.meta.family == "llama"
    assert res.extra["saved_mismatch"] == []
    assert res.graph.op("core_attn").module == "core_attn"


def test_gpt_flash_attention_layer_saves_the_graph_bytes_and_recomputes_bitwise() -> None:
    """GPT with `attention: flash` (SDPA, no dropout): per-op saved bytes are the flash graph's, and every
    policy gives the no-recompute gradients bit for bit."""
    from lynx.runtime.engine import RecomputeEngine
    from lynx.runtime.layers.gpt import GPTLayer, LayerConfig
    from lynx.runtime.layers.gpt_model import GPTModel
    from tests.harness.check import grads_of, method_policy, problem_for, train_step

    cfg = LayerConfig(hidden_size=128, num_attention_heads=8, ffn_hidden_size=256, seq_length=16,
                      micro_batch_size=2, dropout_p=0.0, core_attn=True)
    prob = problem_for(cfg, 3, 64, 2)
    g = runtime_graph(prob.graph, cfg.dtype)
    assert "core_attn" in g.names
    sv = count_saved(GPTLayer(cfg), torch.randn(16, 2, 128, requires_grad=True))
    expect = expected_saved(g)
    for o in g.ops:
        meas = (sv.saved_output_bytes[o.name] if o.name != g.output_op else 0.0) + sv.side_bytes[o.name]
        assert abs(meas - expect[o.name]) <= SAVED_TOLERANCE * max(expect[o.name], 1.0), o.name
    torch.manual_seed(0)
    ref = GPTModel(cfg, 3, 64)
    loss0 = train_step(ref, 2, None, 2)
    g0 = grads_of(ref)
    for m in ("full", "selective", "mc-mlp", "mc-layernorm"):
        model = GPTModel(cfg, 3, 64)
        loss = train_step(model, 2, RecomputeEngine(model.layers, method_policy(m, prob)), 2)
        assert loss == loss0 and all(torch.equal(g0[k], v) for k, v in grads_of(model).items()), m
