"""Collectives over a link: alpha-beta over the slowest link the group spans, ring algorithms as NCCL uses for
large messages (Thakur et al. 2005); the link's efficiency is its measured bus-bandwidth fraction
(docs/costmodel.md, "Links")."""

from __future__ import annotations

from lynx.spec import LinkSpec


def allreduce_time(nbytes: float, n: int, link: LinkSpec, scale: float = 1.0) -> float:
    """Ring all-reduce: 2(n-1) steps each moving nbytes/n (Thakur et al. 2005; NCCL's bus bandwidth)."""
    if n <= 1:
        return 0.0
    bw = link.bandwidth_Bps * min(1.0, link.efficiency * scale)
    return 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * nbytes / bw


def gather_time(nbytes: float, n: int, link: LinkSpec, scale: float = 1.0) -> float:
    """Ring all-gather or reduce-scatter of a tensor of `nbytes` (the gathered size): half an all-reduce's
    traffic, at the link's all-gather / reduce-scatter efficiency."""
    if n <= 1:
        return 0.0
    bw = link.bandwidth_Bps * min(1.0, link.gather_eff * scale)
    return (n - 1) * link.latency_s + (n - 1) / n * nbytes / bw


def p2p_time(nbytes: float, link: LinkSpec, scale: float = 1.0) -> float:
    return link.latency_s + nbytes / (link.bandwidth_Bps * min(1.0, link.efficiency * scale))
