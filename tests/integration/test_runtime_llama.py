"""LLaMA layers under every recomputation policy: loss and parameter gradients equal the no-recompute run
bit for bit on CPU float32 (a recomputation replays the same kernels on the same inputs, SDPA's flash
kernel included), and the bytes the engine holds after forward are the graph's retained bytes.

TP = 1 in process; TP = 2 with two local gloo processes (torch.multiprocessing.spawn), with and without SP."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

from lynx.decisions import LayerPolicy, Phase, RecomputePolicy, validate_layer_policy  # noqa: E402
from lynx.runtime.engine import RecomputeEngine  # noqa: E402
from lynx.runtime.launch import run_ranks  # noqa: E402
from lynx.runtime.layers.llama import LlamaConfig, LlamaModel  # noqa: E402
from tests.harness.check import (  # noqa: E402
    grads_of,
    method_policy,
    problem_for,
    runtime_graph,
    train_step,
)
from tests.policy_equality import compare_policies  # noqa: E402

LAYERS, VOCAB, MBS = 3, 64, 3
RULES = ("none", "full", "selective", "uniform", "block", "mc-core_attn", "mc-mlp", "mc-layernorm",
         "mc-core_attn+mlp", "mc-core_attn+mlp+layernorm")
CFG = LlamaConfig(hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96, seq_length=16,
                  micro_batch_size=2)


def overlapped(num_layers: int) -> RecomputePolicy:
    """A hand-made Lynx-style policy using all four windows and phase 5."""
    lp = LayerPolicy(
        keep=frozenset({"qkv", "core_attn", "attn_residual"}),
        recompute=(("rope", Phase.FWD_ATTN), ("rmsnorm2", Phase.FWD_MLP), ("gate_up", Phase.BWD_MLP),
                   ("swiglu", Phase.ON_DEMAND), ("rmsnorm1", Phase.BWD_ATTN)),
    )
    return RecomputePolicy(method="overlapped", layers=(lp,) * num_layers)


def policies(cfg: LlamaConfig) -> dict[str, RecomputePolicy]:
    from lynx.methods import available_methods, get_method
    from lynx.plan import Plan

    prob = problem_for(cfg, LAYERS, VOCAB, MBS, recompute_num_layers=2)
    out = {m: method_policy(m, prob) for m in RULES}
    if not cfg.sequence_parallel:
        out["overlapped"] = overlapped(LAYERS)
    if "lynx" in available_methods():
        peak = {m: Plan.evaluate(prob, get_method(m).fn(prob)).sim.stages[0].peak_memory_bytes
                for m in ("none", "full")}
        tight = problem_for(cfg, LAYERS, VOCAB, MBS, budget_bytes=(peak["none"] + peak["full"]) / 2)
        out["lynx"] = method_policy("lynx", tight)
        assert out["lynx"].layers[0].recompute, "the budget should force lynx to recompute something"
    for pol in out.values():
        for lp in pol.layers:
            assert not validate_layer_policy(prob.graph, lp, has_fwd_windows=True)
    return out


def compare_all(cfg: LlamaConfig, group=None, in_flight: int = 2) -> dict[str, dict]:
    """Run the reference and every policy; return per policy what differed (empty when equal)."""
    graph = runtime_graph(problem_for(cfg, LAYERS, VOCAB, MBS).graph, cfg.dtype)
    return compare_policies(lambda: LlamaModel(cfg, LAYERS, VOCAB, group), policies(cfg), cfg, graph, MBS, in_flight)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("sp", [False, True])
def test_tp1_every_policy_bitwise_equal(sp: bool) -> None:
    from dataclasses import replace

    res = compare_all(replace(CFG, sequence_parallel=sp), in_flight=1 if sp else 2)
    for name, r in res.items():
        assert r["loss_equal"] and not r["bad"], (name, r["bad"])
        assert r["bytes_equal"], name
    if not sp:
        assert res["overlapped"]["stats"].restored_in_window > 0
    assert res["full"]["stats"].peak_bytes < res["mc-mlp"]["stats"].peak_bytes < res["none"]["stats"].peak_bytes


def test_a_wrong_recompute_breaks_equality() -> None:
    """The test can fail: a recomputed SwiGLU that differs by one ulp changes the gradients."""
    import lynx.runtime.layers.llama as mod

    pol = method_policy("mc-mlp", problem_for(CFG, LAYERS, VOCAB, 1))
    torch.manual_seed(0)
    ref = LlamaModel(CFG, LAYERS, VOCAB)
    train_step(ref, 1, None)
    model = LlamaModel(CFG, LAYERS, VOCAB)
    eng = RecomputeEngine(model.layers, pol)
    orig = mod._SwiGLU.apply

    def perturbed(x):
        y = orig(x)
        return torch.nextafter(y, torch.full_like(y, float("inf"))) if eng._replaying else y

    mod._SwiGLU.apply = perturbed
    try:
        train_step(model, 1, eng)
    finally:
        mod._SwiGLU.apply = orig
    assert any(not torch.equal(a, b) for a, b in zip(grads_of(ref).values(), grads_of(model).values(), strict=True))


def saved_mismatch(cfg: LlamaConfig, group) -> list[str]:
    """Ops whose autograd-saved bytes (saved-tensor hooks) differ from the graph's by more than 2%."""
    from lynx.graph import LAYER_INPUT
    from lynx.profile.measure import count_saved
    from lynx.profile.profiler import SAVED_TOLERANCE, expected_saved
    from lynx.runtime.layers.llama import LlamaLayer

    layer = LlamaLayer(cfg, group)
    graph = runtime_graph(problem_for(cfg, 1, VOCAB, 1).graph, cfg.dtype)
    s_local = cfg.seq_length // cfg.tp if cfg.sequence_parallel else cfg.seq_length
    sv = count_saved(layer, torch.randn(s_local, cfg.micro_batch_size, cfg.hidden_size, requires_grad=True))
    expect = expected_saved(graph)
    meas = {o.name: (sv.saved_output_bytes[o.name] if o.name != graph.output_op else 0.0) + sv.side_bytes[o.name]
            for o in graph.ops}
    for o in graph.ops:  # SP: the column-parallel GEMM saves the gathered input; the engine drops it and
        if o.name.endswith("_allgather"):  # re-gathers in backward (Megatron does): it is the sharded norm's
            meas[o.inputs[0]] += meas.pop(o.name) / cfg.tp
            meas[o.name] = 0.0
    bad = []
    for o in graph.ops:
        if abs(meas[o.name] - expect[o.name]) > SAVED_TOLERANCE * max(expect[o.name], 1.0):
            bad.append(o.name)
    if sv.saved_output_bytes[LAYER_INPUT] != expect[LAYER_INPUT]:
        bad.append(LAYER_INPUT)
    return bad


def _tp2_summary(sp: bool, group: object) -> dict[str, object]:
    from dataclasses import replace

    cfg = replace(CFG, tp=2, sequence_parallel=sp)
    res = compare_all(cfg, group, in_flight=1 if sp else 2)
    summary: dict[str, object] = {k: {"loss_equal": v["loss_equal"], "bad": v["bad"], "bytes_equal": v["bytes_equal"],
                                      "win": v["stats"].restored_in_window} for k, v in res.items()}
    summary["saved_mismatch"] = saved_mismatch(cfg, group)
    return summary


@pytest.mark.parametrize("sp", [False, True])
def test_tp2_every_policy_bitwise_equal(sp: bool, tmp_path) -> None:
    for rank, res in enumerate(run_ranks(functools.partial(_tp2_summary, sp), 2, tmp_path)):
        assert len(res) >= len(RULES)
        assert res.pop("saved_mismatch") == [], rank
        for name, r in res.items():
            assert r["loss_equal"] and not r["bad"], (rank, name, r["bad"])
            assert r["bytes_equal"], (rank, name)
        if not sp:
            assert res["overlapped"]["win"] > 0
