"""Gradient equality: every recomputation policy gives the loss and parameter gradients of the
no-recompute run, bit for bit on CPU float32 (the recomputation replays the same kernels on the same
inputs with the same dropout masks, and backward runs the same graph in the same order).

TP = 1 in process; TP = 2 with two local gloo processes on 127.0.0.1 (torch.multiprocessing.spawn)."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

from lynx.decisions import LayerPolicy, Phase, RecomputePolicy, validate_layer_policy  # noqa: E402
from lynx.runtime.engine import RecomputeEngine  # noqa: E402
from lynx.runtime.launch import run_ranks  # noqa: E402
from lynx.runtime.layers.gpt import LayerConfig  # noqa: E402
from lynx.runtime.layers.gpt_model import GPTModel  # noqa: E402
from tests.harness.check import (  # noqa: E402
    grads_of,
    method_policy,
    problem_for,
    runtime_graph,
    train_step,
)
from tests.policy_equality import compare_policies  # noqa: E402

LAYERS, VOCAB, MBS = 3, 64, 3
RULES = ("none", "full", "selective", "uniform", "block")


def overlapped(num_layers: int) -> RecomputePolicy:
    """A hand-made Lynx-style policy using all four windows (and phase 5 for one op)."""
    lp = LayerPolicy(
        keep=frozenset({"qkv", "attn_context", "attn_residual", "mlp_residual"}),
        recompute=(("attn_scores", Phase.FWD_ATTN), ("softmax", Phase.FWD_ATTN),
                   ("attn_dropout", Phase.FWD_ATTN), ("ln2", Phase.FWD_MLP), ("fc1", Phase.BWD_MLP),
                   ("gelu", Phase.ON_DEMAND), ("ln1", Phase.BWD_ATTN)),
    )
    return RecomputePolicy(method="overlapped", layers=(lp,) * num_layers)


def lynx_available() -> bool:
    from lynx.methods import available_methods

    return "lynx" in available_methods() or "lynx-heu" in available_methods()


def policies(cfg: LayerConfig) -> dict[str, RecomputePolicy]:
    prob = problem_for(cfg, LAYERS, VOCAB, MBS, recompute_num_layers=2)
    out = {m: method_policy(m, prob) for m in RULES}
    if not cfg.sequence_parallel:
        out["overlapped"] = overlapped(LAYERS)
    if lynx_available():
        from lynx.methods import available_methods, get_method

        name = "lynx" if "lynx" in available_methods() else "lynx-heu"
        from lynx.plan import Plan

        peak = {m: Plan.evaluate(prob, get_method(m).fn(prob)).sim.stages[0].peak_memory_bytes
                for m in ("none", "full")}
        tight = problem_for(cfg, LAYERS, VOCAB, MBS, budget_bytes=(peak["none"] + peak["full"]) / 2)
        out[name] = method_policy(name, tight)
        assert out[name].layers[0].recompute, "the budget should force lynx to recompute something"
    for pol in out.values():
        for lp in pol.layers:
            assert not validate_layer_policy(prob.graph, lp, has_fwd_windows=True)
    return out


def compare_all(cfg: LayerConfig, group=None, in_flight: int = 2) -> dict[str, dict]:
    """Run the reference and every policy; return per policy what differed (empty when equal)."""
    graph = runtime_graph(problem_for(cfg, LAYERS, VOCAB, MBS).graph, cfg.dtype)
    return compare_policies(lambda: GPTModel(cfg, LAYERS, VOCAB, group), policies(cfg), cfg, graph, MBS, in_flight)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


CFG = LayerConfig(hidden_size=32, num_attention_heads=4, ffn_hidden_size=128, seq_length=16, micro_batch_size=2)


def test_tp1_every_policy_bitwise_equal() -> None:
    res = compare_all(CFG)
    for name, r in res.items():
        assert r["loss_equal"] and not r["bad"], (name, r["bad"])
        assert r["bytes_equal"], name
    st = res["overlapped"]["stats"]
    # Schedule F0 F1 B0 F2 B1 B2, 3 layers. Per micro-batch j in {0, 1}: the next forward's windows restore
    # its phase-1/2 ops (4 per layer: 12); the backward windows of layers 2 and 1 restore phase 3/4 of
    # layers 1 and 0 (2 each: 4); on demand: the top layer's fc1, ln1, gelu and gelu of layers 0, 1 (5).
    # Micro-batch 2 has no later forward: its top layer is all on demand (7); layers 1 and 0 get ln2 (needed
    # by fc1), fc1 and ln1 in the windows above them (3 each: 6) and the attention ops + gelu on demand (4 each).
    assert (st.restored_in_window, st.restored_on_demand) == (2 * (12 + 4) + 6, 2 * 5 + 7 + 2 * 4)
    assert res["none"]["stats"].restored_on_demand == 0 and res["none"]["stats"].restored_in_window == 0
    assert res["full"]["stats"].peak_bytes < res["selective"]["stats"].peak_bytes < res["none"]["stats"].peak_bytes


def test_a_wrong_recompute_breaks_equality() -> None:
    """The test can fail: recomputing dropout with another micro-batch's mask changes the gradients."""
    import lynx.runtime.layers.gpt as layer_mod

    pol = method_policy("full", problem_for(CFG, LAYERS, VOCAB, 1))
    torch.manual_seed(0)
    ref = GPTModel(CFG, LAYERS, VOCAB)
    train_step(ref, 1, None)
    model = GPTModel(CFG, LAYERS, VOCAB)
    eng = RecomputeEngine(model.layers, pol)
    orig = layer_mod.GPTLayer._dropout
    calls = {"n": 0}

    def shifted(self, x, op, mb):
        calls["n"] += 1
        return orig(self, x, op, mb + (1 if eng._replaying else 0))

    layer_mod.GPTLayer._dropout = shifted
    try:
        train_step(model, 1, eng)
    finally:
        layer_mod.GPTLayer._dropout = orig
    assert calls["n"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(grads_of(ref).values(), grads_of(model).values(), strict=True))


def test_sequence_parallel_tp1_equal() -> None:
    from dataclasses import replace

    res = compare_all(replace(CFG, sequence_parallel=True), in_flight=1)
    for name, r in res.items():
        assert r["loss_equal"] and not r["bad"], (name, r["bad"])


def _tp2_summary(sp: bool, group: object) -> dict[str, object]:
    from dataclasses import replace

    cfg = replace(CFG, tp=2, sequence_parallel=sp)
    res = compare_all(cfg, group, in_flight=1 if sp else 2)
    summary: dict[str, object] = {k: {"loss_equal": v["loss_equal"], "bad": v["bad"], "bytes_equal": v["bytes_equal"],
                                      "win": v["stats"].restored_in_window} for k, v in res.items()}
    return summary


@pytest.mark.parametrize("sp", [False, True])
def test_tp2_every_policy_bitwise_equal(sp: bool, tmp_path) -> None:
    for rank, res in enumerate(run_ranks(functools.partial(_tp2_summary, sp), 2, tmp_path)):
        assert len(res) >= 6
        for name, r in res.items():
            assert r["loss_equal"] and not r["bad"], (rank, name, r["bad"])
            assert r["bytes_equal"], (rank, name)
        if not sp:
            assert res["overlapped"]["win"] > 0
