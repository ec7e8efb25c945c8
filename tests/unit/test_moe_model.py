"""Mixture-of-experts models (docs/decisions/0220): the presets' parameter counts against the published ones,
the layer pattern, expert parallelism's rules, the MoE op list and the all-to-all's links."""

from __future__ import annotations

import dataclasses
import math

import pytest

from lynx.cost.layer import build_layer_graph
from lynx.cost.moe import alltoall_time
from lynx.cost.static_memory import recipe_for, stage_static
from lynx.errors import SpecError
from lynx.models import active_params, load_model, model_from_dict, total_params, validate_layout
from lynx.spec import ParallelSpec, load_hardware, model_to_dict, parallel_to_dict
from lynx.stack import is_uniform, layer_kinds

H100 = "h100-80g-nvlink"


@pytest.mark.parametrize(("name", "total_b", "active_b"), [
    ("mixtral-8x7b", 46.7, 12.9),        # Jiang et al. 2024: 46.7B, 12.9B active
    ("mixtral-8x22b", 141.0, 39.0),      # Mistral AI: 141B, 39B active
    ("qwen3-30b-a3b", 30.5, 3.3),        # Qwen3 report table 1 / model card: 30.5B, 3.3B
    ("qwen3-235b-a22b", 235.0, 22.0),    # 235B, 22B
])
def test_presets_match_published_parameter_counts(name: str, total_b: float, active_b: float) -> None:
    m = load_model(name)
    assert total_params(m) / 1e9 == pytest.approx(total_b, rel=0.01)
    assert active_params(m) / 1e9 == pytest.approx(active_b, rel=0.02)


def test_deepseek_v3_counts_with_and_without_mtp() -> None:
    """671B and 37B active without the MTP module (DeepSeek-V3 report, sec. 1); HF's 685B also counts the MTP
    module's own embedding and head copies (2 x 0.93B), which Megatron shares with the main model."""
    m = load_model("deepseek-v3")
    no_mtp = dataclasses.replace(m, mtp_num_layers=0)
    assert total_params(no_mtp) / 1e9 == pytest.approx(671.0, rel=0.005)
    assert active_params(no_mtp) / 1e9 == pytest.approx(37.0, rel=0.02)
    emb = m.vocab_size * m.hidden_size
    assert (total_params(m) + 2 * emb) / 1e9 == pytest.approx(685.0, rel=0.005)


def test_layer_pattern_follows_megatron_moe_layer_freq() -> None:
    ds = load_model("deepseek-v3")
    kinds = layer_kinds(ds)
    assert kinds[:3] == ("dense",) * 3 and set(kinds[3:]) == {"moe"} and not is_uniform(ds)
    assert is_uniform(load_model("mixtral-8x7b"))
    alt = dataclasses.replace(load_model("mixtral-8x7b"), moe_layer_freq=2)
    assert layer_kinds(alt)[:4] == ("moe", "dense", "moe", "dense")  # i % N == 0 is MoE


def test_moe_fields_refused_outside_mcore_and_bad_pattern() -> None:
    with pytest.raises(SpecError, match="family mcore"):
        model_from_dict({"name": "x", "family": "llama", "num_layers": 2, "hidden_size": 64,
                         "num_attention_heads": 4, "num_moe_experts": 4})
    with pytest.raises(SpecError, match="moe_layer_pattern"):
        model_from_dict({"name": "x", "family": "mcore", "num_layers": 2, "hidden_size": 64,
                         "num_attention_heads": 4, "num_moe_experts": 4, "moe_layer_pattern": [1]})
    with pytest.raises(SpecError, match="moe_router_topk"):
        model_from_dict({"name": "x", "family": "mcore", "num_layers": 2, "hidden_size": 64,
                         "num_attention_heads": 4, "num_moe_experts": 2, "moe_router_topk": 4})


def test_dense_models_written_as_before() -> None:
    d = model_to_dict(load_model("llama3-70b"))
    assert not any(k.startswith("moe_") or k in ("num_moe_experts", "kv_channels") for k in d)
    assert "ep" not in parallel_to_dict(ParallelSpec(tp=2, dp=2, global_batch_size=2))
    ds = model_to_dict(load_model("deepseek-v3"))
    assert ds["moe_layer_pattern"][:4] == [0, 0, 0, 1] and ds["num_moe_experts"] == 256
    assert model_from_dict(ds) == load_model("deepseek-v3")  # a plan file's model reloads as it was


def test_expert_parallel_rules() -> None:
    hw = load_hardware(H100)
    m = load_model("mixtral-8x7b")
    with pytest.raises(SpecError, match="must divide TP x CP x DP"):
        ParallelSpec(tp=2, dp=2, ep=8, global_batch_size=8)  # 8 > TP x DP = 4
    with pytest.raises(SpecError, match="not divisible"):
        validate_layout(m, hw, ParallelSpec(tp=1, dp=3, ep=3, global_batch_size=3))  # 8 experts over 3
    with pytest.raises(SpecError, match="sequence-parallel"):
        validate_layout(m, hw, ParallelSpec(tp=2, dp=4, ep=4, global_batch_size=8))
    with pytest.raises(SpecError, match="no experts"):
        validate_layout(load_model("llama3-8b"), hw, ParallelSpec(tp=1, dp=2, ep=2, global_batch_size=2))
    par = ParallelSpec(tp=2, dp=8, ep=4, sequence_parallel=True, global_batch_size=8, seq_length=4096)
    assert (par.expert_tp, par.edp) == (2, 2)  # 16 ranks: ETP 2 x EP 4 x expert-DP 2
    validate_layout(m, hw, par)


def test_moe_graph_has_dispatch_and_combine_in_the_mlp_window() -> None:
    hw = load_hardware(H100)
    m = load_model("mixtral-8x7b")
    par = ParallelSpec(tp=1, dp=8, ep=8, global_batch_size=8, seq_length=4096)
    g = build_layer_graph(m, hw, par)
    names = g.names
    for op in ("router", "permute", "dispatch_a2a", "experts_fc1", "experts_act", "experts_fc2", "combine_a2a",
               "unpermute"):
        assert op in names
    assert g.op("dispatch_a2a").block == "mlp" and g.op("dispatch_a2a").is_comm
    assert g.fwd_window("mlp") == pytest.approx(g.op("dispatch_a2a").fwd_time + g.op("combine_a2a").fwd_time)
    # EP 1: no all-to-all time, all 8 experts local
    g1 = build_layer_graph(m, hw, dataclasses.replace(par, ep=1))
    assert g1.op("dispatch_a2a").fwd_time == 0.0
    assert g1.op("experts_fc1").fwd_time > g.op("experts_fc1").fwd_time


def test_imbalance_scales_the_busiest_ranks_expert_work() -> None:
    hw = load_hardware(H100)
    m = load_model("mixtral-8x7b")
    par = ParallelSpec(tp=1, dp=8, ep=8, global_batch_size=8, seq_length=4096)
    g = build_layer_graph(m, hw, par)
    g2 = build_layer_graph(dataclasses.replace(m, moe_imbalance=1.5), hw, par)
    assert g2.op("experts_fc1").out_bytes == pytest.approx(1.5 * g.op("experts_fc1").out_bytes)
    capped = build_layer_graph(dataclasses.replace(m, moe_imbalance=1.5, moe_expert_capacity_factor=1.2), hw, par)
    assert capped.op("experts_fc1").out_bytes == pytest.approx(1.2 * g.op("experts_fc1").out_bytes)


def test_alltoall_crosses_the_nic_beyond_a_node() -> None:
    hw = load_hardware(H100)  # 8 GPUs per node, NVLink 450 GB/s, one 50 GB/s NIC per GPU
    nbytes = 64e6
    intra = alltoall_time(nbytes, 8, 1, hw)
    inter = alltoall_time(nbytes, 16, 1, hw)
    assert inter > 3 * intra  # half the bytes leave the node at 1/9 of NVLink's bandwidth
    # spread one rank per node: everything but the own share goes over the NIC
    spread = alltoall_time(nbytes, 4, 8, hw)
    nic = hw.inter_node
    assert spread == pytest.approx(nic.latency_s + 0.75 * nbytes / (nic.bandwidth_Bps * nic.gather_eff))


def test_experts_sharded_by_ep_and_their_optimizer_state_by_expert_dp() -> None:
    m = load_model("mixtral-8x7b")
    r = recipe_for("megatron-bf16")
    p1 = ParallelSpec(tp=1, dp=8, ep=1, global_batch_size=8)
    p8 = ParallelSpec(tp=1, dp=8, ep=8, global_batch_size=8)
    s1, s8 = stage_static(m, p1, 0, 32, r, True), stage_static(m, p8, 0, 32, r, True)
    assert s8.params.experts == pytest.approx(s1.params.experts / 8)
    # distributed optimizer: dense state over DP 8 both times; expert state over expert-DP 8 (EP 1) or 1 (EP 8)
    dense_state = s1.params.total - s1.params.experts
    assert s1.optimizer_bytes == pytest.approx(s1.params.total * r.state_bytes / 8)
    assert s8.optimizer_bytes == pytest.approx(dense_state * r.state_bytes / 8 + s8.params.experts * r.state_bytes)


def test_flex_dispatcher_crosses_each_remote_node_once() -> None:
    """DeepEP (flex): a token goes to a remote node once however many of its top-k experts are there."""
    from lynx.cost.moe import remote_node_copies

    assert remote_node_copies(8, 1) == 0.0
    assert remote_node_copies(1, 4) == pytest.approx(0.75)  # one copy, 3 of 4 nodes remote
    assert remote_node_copies(8, 4) == pytest.approx(4 * (1 - 0.75 ** 8) * 0.75)
    hw = load_hardware(H100)
    m = dataclasses.replace(load_model("qwen3-235b-a22b"), moe_token_dispatcher_type="flex")
    par = ParallelSpec(tp=2, dp=16, ep=32, etp=1, sequence_parallel=True, global_batch_size=16, seq_length=4096)
    flex = build_layer_graph(m, hw, par).op("dispatch_a2a").fwd_time
    a2a = build_layer_graph(dataclasses.replace(m, moe_token_dispatcher_type="alltoall"), hw, par)
    ratio = remote_node_copies(8, 4) / (8 * 0.75)  # remote bytes: deduplicated over every remote copy
    assert flex == pytest.approx(a2a.op("dispatch_a2a").fwd_time * ratio, rel=0.01)


def test_node_limited_routing_bounds_the_nodes_a_flex_token_crosses_to() -> None:
    """DeepSeek-V3's node-limited routing (8 groups, 4 chosen) at EP 64 over 8 nodes: a token's copies reach the
    nodes of its 4 groups, so it crosses to 4 x 7/8 remote nodes, not the 8 x (1 - (7/8)^8) x 7/8 of routing over
    all of them; groups smaller than a node and larger than one follow; groups that do not line up with the
    nodes, or a limit that does not bind, keep the unlimited figure. The alltoall dispatcher sends every copy
    either way, so only flex's price moves."""
    from lynx.cost.moe import remote_node_copies

    free = remote_node_copies(8, 8)
    assert remote_node_copies(8, 8, 8, 4) == pytest.approx(4 * 7 / 8)
    assert remote_node_copies(8, 8, 16, 4) == pytest.approx(8 * (1 - math.comb(14, 4) / math.comb(16, 4)) * 7 / 8)
    assert remote_node_copies(8, 16, 8, 4) == pytest.approx(4 * 2 * (1 - 0.5 ** 2) * 15 / 16)
    assert remote_node_copies(8, 8, 6, 3) == remote_node_copies(8, 8, 8, 8) == free
    hw = load_hardware(H100)
    ds = load_model("deepseek-v3")
    par = ParallelSpec(tp=1, dp=64, ep=64, etp=1, global_batch_size=64, seq_length=4096)
    times = {}
    for disp in ("flex", "alltoall"):
        for groups in ((8, 4), (0, 0)):
            m = dataclasses.replace(ds, moe_token_dispatcher_type=disp, moe_router_num_groups=groups[0],
                                    moe_router_group_topk=groups[1])
            times[disp, groups] = build_layer_graph(m, hw, par).op("dispatch_a2a").fwd_time
    assert times["alltoall", (8, 4)] == times["alltoall", (0, 0)]
    assert times["flex", (8, 4)] < times["flex", (0, 0)]


def test_megatron_moe_recompute_modules() -> None:
    """--recompute-modules moe re-runs the whole MoE block (its all-to-alls too) on demand; moe_act discards the
    experts' activation output only."""
    from lynx.policy.megatron_modules import dropped_ops, modules_layer

    hw = load_hardware(H100)
    par = ParallelSpec(tp=1, dp=8, ep=8, global_batch_size=8, seq_length=4096)
    g = build_layer_graph(load_model("mixtral-8x7b"), hw, par)
    assert dropped_ops(g, ("moe_act",)) == {"experts_act"}
    moe = modules_layer(g, ("moe",))
    rerun = {n for n, _ in moe.recompute}
    assert {"dispatch_a2a", "experts_fc1", "experts_act", "combine_a2a"} <= rerun
    assert "core_attn" in moe.keep and "rmsnorm2" in moe.keep  # outside the block, and its input, stay


def test_multi_token_prediction_is_priced_on_the_last_stage() -> None:
    """DeepSeek-V3's MTP layer (--mtp-num-layers 1) runs after the last stage's decoder layers: its time (the
    shifted tokens' embedding, two norms, the 2h -> h projection, one transformer layer of the primary kind, its own
    LM head and loss) is added to the last stage's head, and its activations for one micro-batch (the layer kept
    whole, the projection's input and output, a second set of logits) to the last stage's transient bytes; the
    first stages and a model without MTP are priced as before."""
    from lynx.api import make_problem
    from lynx.cost.edges import stage_edge_times
    from lynx.cost.layer import edge_times
    from lynx.cost.memory import extra_transient_bytes, layer_memories, mtp_bytes
    from lynx.decisions import LayerPolicy
    from lynx.problem import PlanOptions

    hw = load_hardware(H100)
    ds = load_model("deepseek-v3")
    par = ParallelSpec(tp=2, pp=8, dp=64, ep=64, etp=1, sequence_parallel=True, micro_batch_size=1,
                       global_batch_size=8192, seq_length=4096)
    prob = make_problem(ds, hw, par, PlanOptions(vpp=4, precision="megatron-bf16", nodes=128))
    g = prob.graph
    plain, with_mtp = edge_times(ds, hw, par), stage_edge_times(ds, hw, par, g)
    assert with_mtp.head_fwd - plain.head_fwd > g.fwd_time() + plain.head_fwd
    assert with_mtp.head_bwd - plain.head_bwd > g.bwd_time() + plain.head_bwd
    assert with_mtp.embedding_fwd == plain.embedding_fwd
    no_mtp = dataclasses.replace(ds, mtp_num_layers=0)
    assert stage_edge_times(no_mtp, hw, par, g) == edge_times(no_mtp, hw, par)
    keep = layer_memories(g, (LayerPolicy(g.needed()),))[0].retained
    assert mtp_bytes(ds, par, 7, g) > keep + extra_transient_bytes(ds, par, 7)
    assert mtp_bytes(ds, par, 6, g) == mtp_bytes(no_mtp, par, 7, g) == 0.0
    last = prob.stage_context(7, 8, chunk_layers=(2, 2, 2, 2), kinds=("moe",) * 8)
    first = prob.stage_context(0, 8, chunk_layers=(2, 2, 2, 2), kinds=("dense",) * 3 + ("moe",) * 5)
    assert last.extra_transient_bytes == extra_transient_bytes(ds, par, 7) + mtp_bytes(ds, par, 7, g)
    assert first.extra_transient_bytes == 0.0
