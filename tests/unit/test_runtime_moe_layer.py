"""The MoE runtime layer's math on one process (EP 1, no process group): its MLP block equals a direct
computation of top-k routing, each token's k experts weighted by the router's probabilities, and the shared
expert; and the dispatch layout helpers regroup and restore the token copies exactly."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from lynx.runtime.layers import moe_dispatch as md  # noqa: E402
from lynx.runtime.layers.moe import MoEConfig, MoELayer  # noqa: E402


def _cfg() -> MoEConfig:
    return MoEConfig(hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48, seq_length=8,
                     micro_batch_size=2, num_experts=4, topk=2, expert_ffn=16, ep=1, dtype=torch.float64)


def _swiglu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ w).chunk(2, -1)
    return F.silu(gate) * up


def test_the_moe_block_is_topk_routing_over_the_experts_plus_the_shared_expert(one_torch_thread: None) -> None:
    cfg = _cfg()
    layer = MoELayer(cfg, seed=7)
    assert "dispatch_a2a" in layer.op_names and "combine_a2a" in layer.op_names
    x = torch.randn(cfg.seq_length, cfg.micro_batch_size, cfg.hidden_size, dtype=torch.float64)
    env = {"input": x}
    for name in layer.op_names:
        env[name] = layer.run_op(name, env, 0)
    n = env["rmsnorm2"].reshape(-1, cfg.hidden_size)
    logits = n @ layer.router
    vals, ids = logits.topk(cfg.topk, -1)
    probs = torch.softmax(vals, -1)
    routed = torch.zeros_like(n)
    for t in range(n.shape[0]):
        for j in range(cfg.topk):
            e = int(ids[t, j])
            routed[t] += probs[t, j] * (_swiglu(n[t], layer.experts_w1[e]) @ layer.experts_w2[e])
    shared = F.linear(_swiglu_t(n, layer.shared_up.weight), layer.shared_down.weight)
    want = routed + shared + env["attn_residual"].reshape(-1, cfg.hidden_size)
    torch.testing.assert_close(env["mlp_residual"].reshape(-1, cfg.hidden_size), want, rtol=1e-10, atol=1e-12)
    # every expert received tokens (else the check above would not reach the per-expert GEMMs)
    assert (torch.bincount(ids.reshape(-1), minlength=cfg.num_experts) > 0).all()


def _swiglu_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a column-parallel [gate | up] weight in torch's [out, in] layout (TP 1: one shard)."""
    gate, up = F.linear(x, w).chunk(2, -1)
    return F.silu(gate) * up


def test_grouping_by_local_expert_and_back_is_exact() -> None:
    s = md.Splits(send=(3, 2), recv=((1, 2), (0, 3), (2, 1)))  # three sources, two local experts
    order = s.grouped_order()
    assert s.recv_per_src == [3, 3, 3] and s.per_expert == [3, 6]
    # rows 0 | 1 2 from source 0, - | 3 4 5 from source 1, 6 7 | 8 from source 2: expert 0 first
    assert order == [0, 6, 7, 1, 2, 3, 4, 5, 8]
    x = torch.arange(9.0)[:, None]
    grouped = x[torch.tensor(order)]  # what `dispatch` makes of the received rows
    back = md.combine(grouped, md.Splits(send=(9,), recv=s.recv), None, None, None)  # EP 1: the inverse only
    assert torch.equal(back, x)


def test_a_layer_refuses_an_ep_that_does_not_match_its_group() -> None:
    with pytest.raises(ValueError, match="EP group has 1 ranks"):
        MoELayer(MoEConfig(hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, seq_length=8,
                           micro_batch_size=2, num_experts=4, ep=2))


def test_a_pipeline_layout_refuses_an_ep_that_does_not_fold_into_tp_x_dp() -> None:
    from lynx.runtime.pipeline import LayoutError, PipelineLayout

    def layout(ep: int, etp: int = 1) -> PipelineLayout:
        return PipelineLayout(tp=2, pp=1, dp=1, vpp=1, layers_per_stage=(2,), policies=(None,), num_microbatches=1,
                              ep=ep, etp=etp)

    assert layout(2).ep == 2
    with pytest.raises(LayoutError, match="EP 4 x ETP 1 must divide TP 2 x DP 1"):
        layout(4)
    with pytest.raises(LayoutError, match="EP 2 x ETP 2 must divide TP 2 x DP 1"):
        layout(2, 2)
    assert layout(1, 2).etp == 2


def test_unpermute_saves_no_copy_of_its_input_beyond_the_input_itself() -> None:
    """What `unpermute` leaves autograd is Megatron's: the combine's output itself, the gathered probabilities
    and int64 indices; never a second tok x k x h tensor (`index_add` saved its weighted source: 12% of the
    activations the plan did not price, docs/decisions/0225). Its value is the probability-weighted sum."""
    tok, k, h = 6, 2, 8
    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(4, generator=gen)[:k] for _ in range(tok)]).double()
    probs = torch.softmax(torch.randn(tok, k, generator=gen, dtype=torch.float64), -1).requires_grad_()
    rt = torch.cat([probs, ids], -1)
    y = torch.randn(tok * k, h, generator=gen, dtype=torch.float64, requires_grad=True)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = md.unpermute(y, rt, k)
    big = [t for t in saved if t.is_floating_point() and t.numel() >= tok * h]
    assert big and all(t.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for t in big), \
        [tuple(t.shape) for t in big]
    order = md.sort_by_expert(ids.long())
    want = torch.zeros(tok, h, dtype=torch.float64)
    for row, copy in enumerate(order.tolist()):
        want[copy // k] += probs.reshape(-1)[copy] * y[row]
    torch.testing.assert_close(out, want)
