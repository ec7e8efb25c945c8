"""The runtime layer speaks the planner's op vocabulary, and its saved bytes are the graph's bytes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from lynx.cost.layer import build_layer_graph  # noqa: E402
from lynx.decisions import validate_layer_policy  # noqa: E402
from lynx.families.gpt import SP_OPS, STANDARD_OPS  # noqa: E402
from lynx.runtime.engine import RecomputeEngine  # noqa: E402
from lynx.runtime.layers.gpt import GPTLayer, LayerConfig, op_inputs_for, op_names_for  # noqa: E402
from lynx.runtime.layers.gpt_model import GPTModel  # noqa: E402
from lynx.spec import ParallelSpec, load_hardware  # noqa: E402
from tests.harness.check import (  # noqa: E402
    method_policy,
    problem_for,
    runtime_extra_bytes,
    runtime_graph,
    train_step,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


CFG = LayerConfig(hidden_size=32, num_attention_heads=4, ffn_hidden_size=128, seq_length=16, micro_batch_size=2)


@pytest.mark.parametrize("sp", [False, True])
def test_op_names_and_inputs_match_the_graph(sp: bool) -> None:
    from tests.harness.check import model_spec

    cfg = LayerConfig(32, 4, 128, 16, 2, tp=2, sequence_parallel=sp)
    par = ParallelSpec(tp=2, sequence_parallel=sp, seq_length=16, micro_batch_size=2, global_batch_size=2)
    g = build_layer_graph(model_spec(cfg, 2, 64), load_hardware("a100-40g-nvlink"), par)
    names = op_names_for(cfg)
    assert names == (SP_OPS if sp else STANDARD_OPS) == g.names
    ins = op_inputs_for(names)
    assert all(ins[o.name] == o.inputs for o in g.ops)


def test_core_attn_and_no_dropout_vocabularies() -> None:
    from dataclasses import replace

    names = op_names_for(replace(CFG, core_attn=True))
    assert "core_attn" in names and "attn_scores" not in names and "softmax" not in names
    assert "attn_dropout" not in op_names_for(replace(CFG, dropout_p=0.0))


def test_run_op_is_forward_and_dropout_reproducible() -> None:
    layer = GPTLayer(CFG, layer_index=3)
    x = torch.randn(16, 2, 32)
    env = {"input": x}
    for n in layer.op_names:
        env[n] = layer.run_op(n, env, microbatch=5)
    assert torch.equal(env["mlp_residual"], layer(x, microbatch=5))
    again = layer.run_op("attn_dropout", env, microbatch=5)
    assert torch.equal(again, env["attn_dropout"])
    other = layer.run_op("attn_dropout", env, microbatch=6)  # another micro-batch draws another mask
    assert not torch.equal(other, env["attn_dropout"])
    with pytest.raises(KeyError):
        layer.run_op("core_attn", env)


def test_sdpa_core_attn_matches_standard_attention_without_dropout() -> None:
    from dataclasses import replace

    cfg = replace(CFG, dropout_p=0.0)
    a, b = GPTLayer(cfg), GPTLayer(replace(cfg, core_attn=True))
    x = torch.randn(16, 2, 32)
    torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["none", "full", "selective", "block"])
def test_held_bytes_equal_the_graph_accounting(method: str) -> None:
    """What the engine holds after forward is exactly the graph's retained bytes (float32 activations,
    1-byte masks) plus the LayerNorm statistics the graph folds away."""
    layers, vocab = 3, 64
    prob = problem_for(CFG, layers, vocab, 1, recompute_num_layers=1)
    pol = method_policy(method, prob)
    g = runtime_graph(prob.graph, CFG.dtype)
    model = GPTModel(CFG, layers, vocab)
    eng = RecomputeEngine(model.layers, pol)
    train_step(model, 1, eng)
    expected = sum(g.retained_bytes(lp.keep) + runtime_extra_bytes(CFG, lp.keep) for lp in pol.layers)
    assert eng.stats.fwd_end_bytes == [expected]
    for lp in pol.layers:
        assert not validate_layer_policy(prob.graph, lp, has_fwd_windows=False)
