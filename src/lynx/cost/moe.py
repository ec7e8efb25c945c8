"""Expert-parallel collectives: the token dispatch and combine of an MoE layer (`families.moe`), priced on the
links their groups cross (docs/decisions/0220).

Groups follow Megatron-Core's expert rank order (megatron/core/parallel_state.py, the expert RankGenerator with
order tp-cp-ep-dp-pp and cp = 1): within a pipeline stage ETP is innermost, then EP, then expert-DP. So an EP
group is EP ranks ETP apart, an ETP group is ETP neighbours, and the allgather dispatcher's TP x EP group is
ETP x EP neighbours.

An all-to-all over n ranks sends (n - 1) / n of each rank's tensor to its peers, all peers at once (NCCL's
alltoall: one send and receive per peer; nccl-tests alltoall_perf reports bus bandwidth with the same (n - 1) / n
factor as all-gather, so the link's all-gather efficiency applies). When the group spans nodes, the share for
peers on this rank's node goes over NVLink and the rest over the node's NICs, both at once: the slower part
sets the time. Every GPU of the node runs its own all-to-all at the same moment (each EP group of the node
dispatches in the same layer), so each gets `nics_per_node / devices_per_node` of the node's NICs.
"""

from __future__ import annotations

import math

from lynx.cost.collectives import gather_time
from lynx.families.base import OpSpec
from lynx.graph import Op
from lynx.spec import Hardware, ParallelSpec

EXPERT_COLLECTIVES = frozenset({"ep_a2a", "etp_gather", "tpep_gather"})


def alltoall_time(nbytes: float, n: int, stride: int, hw: Hardware, scale: float = 1.0, dedup_topk: int = 0,
                  groups: tuple[int, int] = (0, 0)) -> float:
    """All-to-all of a rank's `nbytes` (its own share included) over `n` ranks `stride` apart. `dedup_topk` > 0:
    `nbytes` is that many copies per token, and a token crosses to each remote node once (`remote_node_copies`,
    with the router's group limit `groups`), the copies for the node's other GPUs forwarded over NVLink."""
    if n <= 1:
        return 0.0
    d = hw.devices_per_node
    ranks = [i * stride for i in range(n)]
    local = [r for r in ranks if r // d == 0]
    k = len(local)
    t_intra = 0.0
    if k > 1:
        link = hw.link_for_ranks(local)
        t_intra = link.latency_s + (k - 1) / n * nbytes / (link.bandwidth_Bps * min(1.0, link.gather_eff * scale))
    if k == n:
        return t_intra
    nic = hw.inter_node
    nic_bw = nic.bandwidth_Bps * hw.nics_per_node / d
    remote = (n - k) / n * nbytes
    if dedup_topk > 0:
        remote = nbytes / dedup_topk * remote_node_copies(dedup_topk, n // k, *groups)
        if k > 1:  # every copy for another GPU reaches it over NVLink (forwarded or local)
            link = hw.link_for_ranks(local)
            t_intra = link.latency_s + (n - 1) / n * nbytes / (link.bandwidth_Bps * min(1.0, link.gather_eff * scale))
    t_inter = nic.latency_s + remote / (nic_bw * min(1.0, nic.gather_eff * scale))
    return max(t_intra, t_inter)


def remote_node_copies(topk: int, nodes: int, num_groups: int = 0, group_topk: int = 0) -> float:
    """Expected remote nodes a token's top-k experts fall on, experts spread evenly over `nodes` nodes and chosen
    uniformly (balanced routing): nodes x (1 - (1 - 1/nodes)^k) distinct nodes, of which a share (nodes - 1) /
    nodes remote.

    Group-limited routing (Megatron's --moe-router-num-groups G / --moe-router-group-topk g, DeepSeek-V3's
    node-limited routing: 8 groups, 4 chosen) keeps a token's experts inside g of G equal groups of consecutive
    experts, which is what the EP ranks hold, so the groups line up with the nodes when one count divides the
    other. Groups ranked by their top (k / g) scores each get some of the token's experts (k / g on average; each
    counted as hit): G a multiple of the nodes, the g groups of a token are g of G chosen uniformly, and the nodes
    hit are the nodes they cover, nodes x (1 - C(G - G/nodes, g) / C(G, g)) (g exactly when G = nodes); fewer
    groups than nodes, each chosen group spans nodes / G nodes and its k / g experts fall uniformly on them. Groups
    that do not line up with the nodes: the unlimited figure (an upper bound)."""
    if nodes <= 1:
        return 0.0
    hit = nodes * (1.0 - (1.0 - 1.0 / nodes) ** topk)
    if group_topk and num_groups and group_topk < num_groups:
        if num_groups % nodes == 0:
            per = num_groups // nodes
            hit = min(hit, nodes * (1.0 - math.comb(num_groups - per, group_topk) / math.comb(num_groups, group_topk)))
        elif nodes % num_groups == 0:
            span = nodes // num_groups
            hit = min(hit, group_topk * span * (1.0 - (1.0 - 1.0 / span) ** (topk / group_topk)))
    return hit * (nodes - 1) / nodes


def price_expert_comm(o: OpSpec, hw: Hardware, par: ParallelSpec, scale: float = 1.0) -> Op:
    """A dispatch or combine collective: the all-to-all over EP, or the ring all-gather / reduce-scatter over
    ETP (alltoall dispatcher) or TP x EP (allgather dispatcher). Backward runs the mirror collective on the
    gradients, the same bytes; no GEMM's weight gradient hides it (Megatron-Core runs none beside it)."""
    if o.collective == "ep_a2a":
        t = alltoall_time(o.comm_bytes, par.ep, par.expert_tp, hw, scale, o.node_dedup_topk, o.node_groups)
    else:
        n = par.expert_tp if o.collective == "etp_gather" else par.expert_tp * par.ep
        t = gather_time(o.comm_bytes, n, hw.link_for_group(n, 1), scale)
    return Op(name=o.name, kind="comm", block=o.block, fwd_time=t, bwd_time=t, out_bytes=o.out_bytes,
              inputs=o.inputs, saved=(), module=o.module)


__all__ = ["EXPERT_COLLECTIVES", "alltoall_time", "price_expert_comm"]
