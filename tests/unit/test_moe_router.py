"""The runtime's MoE router (`lynx.runtime.layers.moe_dispatch.Router`) against Megatron-Core 0.16.1's own
`topk_routing_with_score_function` (the function its TopKRouter calls): the same experts, bitwise the same weights
and the same gradient of the logits, for Megatron's default router, the softmax before the top-k, and DeepSeek-V3's
sigmoid router with the expert bias, top-k scaling and group-limited choice. The bias update against the rule of
Megatron's get_updated_expert_bias, on counts where the sign of each expert's offset is known."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from lynx.runtime.layers.moe_dispatch import Router, updated_expert_bias  # noqa: E402

CASES = [
    pytest.param(Router(2), False, id="softmax-after-topk"),
    pytest.param(Router(2, pre_softmax=True), False, id="softmax-before-topk"),
    pytest.param(Router(1, pre_softmax=True), False, id="top1-pre-softmax"),
    pytest.param(Router(4, "sigmoid"), False, id="sigmoid"),
    pytest.param(Router(8, "sigmoid", scaling=2.5, groups=(8, 4)), True, id="deepseek-v3"),
    pytest.param(Router(2, "sigmoid", scaling=2.5, groups=(4, 2)), True, id="deepseek-v3-tiny"),
    pytest.param(Router(6, groups=(4, 2)), False, id="softmax-groups"),
]


@pytest.mark.parametrize(("router", "bias"), CASES)
def test_the_router_routes_as_megatron_core(router: Router, bias: bool) -> None:
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    experts = 32 if router.groups[0] == 8 else 8 * (router.topk > 2) + 8
    g = torch.Generator().manual_seed(router.topk)
    logits = torch.randn(64, experts, generator=g, dtype=torch.float32)
    b = torch.randn(experts, generator=g) * 0.3 if bias else None
    ours_in = logits.clone().requires_grad_()
    theirs_in = logits.clone().requires_grad_()
    probs, ids = router(ours_in, b)
    want_probs, want_map = moe_utils.topk_routing_with_score_function(
        theirs_in, router.topk, use_pre_softmax=router.pre_softmax,
        num_groups=router.groups[0] or None, group_topk=router.groups[1] or None, scaling_factor=router.scaling,
        score_function=router.score_function, expert_bias=b)
    got_map = torch.zeros_like(want_map).scatter(1, ids, True)
    assert torch.equal(got_map, want_map)
    assert torch.equal(torch.zeros_like(want_probs).scatter(1, ids, probs), want_probs)
    w = torch.randn(64, experts, generator=g)
    (torch.zeros_like(want_probs).scatter(1, ids, probs) * w).sum().backward()
    (want_probs * w).sum().backward()
    assert torch.equal(ours_in.grad, theirs_in.grad)


def test_the_group_limit_keeps_a_token_in_its_best_group() -> None:
    """Scores of 4 groups of 2: [0.9, 0.1 | 0.0, 0.7 | 0.8, 0.2 | 0.3, 0.75]. Unlimited, the top 2 are experts 0 and
    4 (groups 0 and 2); with one group allowed, the group of the highest sum of its top 2 (group 3, 1.05) gives
    both."""
    scores = torch.tensor([[0.9, 0.1, 0.0, 0.7, 0.8, 0.2, 0.3, 0.75]])
    assert sorted(Router(2, "sigmoid").choose(scores)[1].tolist()[0]) == [0, 4]
    assert sorted(Router(2, "sigmoid", groups=(4, 1)).choose(scores)[1].tolist()[0]) == [6, 7]


def test_the_bias_moves_each_expert_towards_the_mean() -> None:
    """Counts [3, 1, 2, 2] (mean 2): the busy expert's bias down by the rate, the idle one's up, the balanced ones
    unchanged (Megatron's sign rule), per layer row."""
    bias = torch.tensor([[0.5, 0.0, -0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])
    tokens = torch.tensor([[3.0, 1.0, 2.0, 2.0], [0.0, 0.0, 4.0, 0.0]])
    got = updated_expert_bias(bias, tokens, 1e-3)
    want = torch.tensor([[0.5 - 1e-3, 1e-3, -0.25, 0.0], [1e-3, 1e-3, -1e-3, 1e-3]])
    assert torch.equal(got, want)


def test_the_layer_routes_with_its_expert_bias() -> None:
    """deepseek-v3-tiny's runtime layer: its router is the preset's (sigmoid, 2 of 4 groups, scaling 2.5) and
    reads the layer's expert bias, a fp32 buffer starting at zero: a large bias on expert 3 puts every token's
    copies there, with the weights still from the scores alone (the two of a token sum to the scaling)."""
    from lynx.models import load_model
    from lynx.runtime.layers.family import runtime_for
    from lynx.runtime.layers.moe import MoELayer
    from lynx.spec import ParallelSpec

    model = load_model("deepseek-v3-tiny")
    par = ParallelSpec(tp=1, pp=1, dp=1, micro_batch_size=2, global_batch_size=2, seq_length=16)
    cfg = runtime_for(model).config(model, par, torch.float32, False)
    layer = MoELayer(cfg, layer_index=1)
    assert layer.expert_bias is not None and layer.expert_bias.dtype == torch.float32
    assert not layer.expert_bias.any()
    assert cfg.routing == Router(2, "sigmoid", scaling=2.5, groups=(4, 2))
    logits = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    before = layer._router_topk(logits)[:, 2:]
    assert not (before == 3).all(dim=0).any()
    layer.expert_bias[3] = 10.0
    out = layer._router_topk(logits)
    assert (out[:, 2:] == 3).any(dim=1).all()
    assert torch.allclose(out[:, :2].sum(-1), torch.full((32,), 2.5))
