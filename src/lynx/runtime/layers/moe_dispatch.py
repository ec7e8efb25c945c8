"""Token routing of an MoE layer on the expert-parallel group: top-k routing, the permutation of token copies by
expert, and the dispatch / combine all-to-alls (`torch.distributed.all_to_all_single`, gloo or NCCL) with the
recompute engine's windows open while each is in flight, forward and backward, as the TP collectives do
(`lynx.runtime.layers.tp`).

Layout of one rank's token copies (Megatron-Core's alltoall dispatcher, token_dispatcher.py): the tok x k copies
sorted by expert (stable, so a copy's order inside an expert is its token order); experts are split contiguously
over EP ranks, so that order is also grouped by destination rank. A rank receives, from each source rank in
turn, that source's copies for its local experts (expert order inside); the experts run on them regrouped by
local expert, and the reverse order sends the outputs back."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lynx.runtime.layers import tp
from lynx.runtime.layers.tp import Group, Window


@dataclass(frozen=True)
class Router:
    """How the router turns its [tok, E] fp32 logits into k experts and their weights: Megatron-Core's top-k router
    (moe_router_* of TransformerConfig; the same rules as `topk_routing_with_score_function`, written here)."""

    topk: int
    score_function: str = "softmax"
    """softmax: over the top-k logits, or (pre_softmax) over every expert before the top-k; sigmoid: each
    expert's score alone, the k chosen ones normalized to sum to 1 (k > 1)."""
    pre_softmax: bool = False
    scaling: float | None = None
    """The weights multiplied by it (DeepSeek-V3: 2.5)."""
    groups: tuple[int, int] = (0, 0)
    """(G, g): the experts in G equal groups, a token's experts chosen from the g groups with the highest sums of
    their top (k / g) scores; (0, 0): no group limit."""

    def choose(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, ids) of the top k of `scores` [tok, E], within the chosen groups when there is a limit."""
        n_groups, g = self.groups
        if not g:
            return scores.topk(self.topk, -1)
        t, e = scores.shape
        ranked = scores.view(t, n_groups, e // n_groups).topk(self.topk // g, -1)[0].sum(-1)
        keep = torch.zeros_like(ranked).scatter(1, ranked.topk(g, -1, sorted=False)[1], 1.0).bool()
        keep = keep.unsqueeze(-1).expand(t, n_groups, e // n_groups).reshape(t, e)
        return scores.masked_fill(~keep, float("-inf")).topk(self.topk, -1)

    def __call__(self, logits: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs [tok, k], expert ids [tok, k]) from fp32 logits; `bias` (sigmoid only) moves the choice, not the
        weights (DeepSeek-V3's auxiliary-loss-free balancing)."""
        if self.score_function == "softmax":
            if self.pre_softmax:
                probs, ids = self.choose(torch.softmax(logits, -1))
            else:
                top, ids = self.choose(logits)
                probs = torch.softmax(top, -1)
        else:
            scores = torch.sigmoid(logits)
            if bias is None:
                probs, ids = self.choose(scores)
            else:
                ids = self.choose(scores + bias)[1]
                probs = scores.gather(1, ids)
            if self.topk > 1:
                probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
        if self.scaling:
            probs = probs * self.scaling
        return probs, ids


def updated_expert_bias(bias: torch.Tensor, tokens: torch.Tensor, rate: float) -> torch.Tensor:
    """After a step: each expert's bias moved by `rate` towards balance, up where the expert got fewer token copies
    than the mean over experts of the step's global batch (`tokens`, [..., E]), down where it got more."""
    return bias + torch.sign(tokens.sum(-1, keepdim=True) / tokens.shape[-1] - tokens) * rate


def route(router_out: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [tok, k], expert ids [tok, k]) from the router_topk op's output [tok, 2k] = [probs | ids]."""
    return router_out[:, :k], router_out[:, k:].detach().long()


def sort_by_expert(ids: torch.Tensor) -> torch.Tensor:
    """The order of the tok x k copies sorted by expert (stable: token order inside an expert)."""
    return torch.argsort(ids.reshape(-1), stable=True)


@dataclass(frozen=True)
class Splits:
    """One micro-batch's dispatch sizes on this rank (plain ints: a replay recomputes the same)."""

    send: tuple[int, ...]
    """Copies sent to each EP rank."""
    recv: tuple[tuple[int, ...], ...]
    """recv[src][e]: copies received from EP rank src for local expert e."""

    @property
    def recv_per_src(self) -> list[int]:
        return [sum(r) for r in self.recv]

    @property
    def per_expert(self) -> list[int]:
        """Copies each local expert computes (all sources)."""
        return [sum(r[e] for r in self.recv) for e in range(len(self.recv[0]))]

    def grouped_order(self) -> list[int]:
        """Received rows (source-major) in local-expert-major order."""
        starts, s = [], 0
        for r in self.recv:
            starts.append(s)
            s += sum(r)
        order: list[int] = []
        for e in range(len(self.recv[0])):
            for src, r in enumerate(self.recv):
                off = starts[src] + sum(r[:e])
                order.extend(range(off, off + r[e]))
        return order


def exchange_counts(per_expert: torch.Tensor, group: Group) -> Splits:
    """The per-expert copy counts of every EP rank's dispatch (a small blocking all-to-all of counts)."""
    n = tp.world(group)
    local = per_expert.numel() // n
    send = [int(c) for c in per_expert.view(n, local).sum(1)]
    if n == 1:
        return Splits(tuple(send), (tuple(int(c) for c in per_expert),))
    got = torch.empty_like(per_expert)
    dist.all_to_all_single(got, per_expert.contiguous(), group=group)
    return Splits(tuple(send), tuple(tuple(int(c) for c in row) for row in got.view(n, local)))


def _all_to_all(x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: Group, window: Window
                ) -> torch.Tensor:
    """Rows `in_rows[r]` of x to rank r, `out_rows[r]` rows from rank r; `window` runs while in flight."""
    if tp.world(group) == 1:
        if window is not None:
            window()
        return x.clone()
    x = x.contiguous()
    out = x.new_empty((sum(out_rows), *x.shape[1:]))
    work = dist.all_to_all_single(out, x, out_rows, in_rows, group=group, async_op=True)
    if window is not None:
        window()
    assert work is not None
    work.wait()
    return out


class AllToAllFn(torch.autograd.Function):
    """The token all-to-all: forward sends with `in_rows` / receives `out_rows`, backward the reverse; each
    direction opens its window while the collective is in flight. Saves nothing."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: Group,
                fwd_window: Window, bwd_window: Window) -> torch.Tensor:
        ctx.rows, ctx.group, ctx.bwd_window = (out_rows, in_rows), group, bwd_window
        return _all_to_all(x, out_rows, in_rows, group, fwd_window)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        out_rows, in_rows = ctx.rows
        return _all_to_all(g, in_rows, out_rows, ctx.group, ctx.bwd_window), None, None, None, None, None


def dispatch(x: torch.Tensor, splits: Splits, group: Group, fwd: Window, bwd: Window, regroup: bool = True
             ) -> torch.Tensor:
    """This rank's copies sorted by expert -> the copies its local experts compute, grouped by local expert
    (`regroup` False: as received, source-major, for the ETP all-gather to group)."""
    raw = tp.apply_fn(AllToAllFn, x, splits.recv_per_src, list(splits.send), group, fwd, bwd)
    return raw[_order(splits, x.device)] if regroup else raw


def combine(y: torch.Tensor, splits: Splits, group: Group, fwd: Window, bwd: Window, regroup: bool = True
            ) -> torch.Tensor:
    """The local experts' outputs (grouped by local expert; `regroup` False: already source-major) -> this rank's
    copies, sorted by expert."""
    src = y[_inverse(_order(splits, y.device))] if regroup else y
    return tp.apply_fn(AllToAllFn, src, list(splits.send), splits.recv_per_src, group, fwd, bwd)


def _order(splits: Splits, device: torch.device) -> torch.Tensor:
    return torch.tensor(splits.grouped_order(), dtype=torch.long, device=device)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


# -- expert tensor parallelism (ETP > 1: Megatron's alltoall dispatcher gathers over the expert-TP group) -----------
def gather_splits(splits: Splits, group: Group) -> Splits:
    """Every ETP rank's received counts in group order, as one Splits whose sources are (ETP rank, EP source) pairs:
    the rows an all-gather of each rank's source-major copies holds, and their grouping by local expert."""
    mine = torch.tensor(splits.recv, dtype=torch.long)
    parts = [torch.empty_like(mine) for _ in range(tp.world(group))]
    dist.all_gather(parts, mine, group=group)
    return Splits(splits.send, tuple(tuple(int(c) for c in row) for p in parts for row in p))


def _rows(g: Splits, n: int) -> list[int]:
    """Rows each of the n ETP ranks contributes to a gathered Splits `g`."""
    per = len(g.recv) // n
    return [sum(sum(r) for r in g.recv[i * per:(i + 1) * per]) for i in range(n)]


@functools.lru_cache(maxsize=64)
def _padded_positions(g: Splits, n: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(where each gathered copy, grouped by local expert, sits in the padded all-gather [n x most rows], most
    rows): the all-gather moves equal blocks, so each rank's copies are padded to the largest count. Cached: the
    gather and the reduce-scatter of a micro-batch (and a restoration of either) read the same positions."""
    rows = _rows(g, n)
    most = max(rows)
    valid = torch.cat([torch.arange(rows[i], device=device) + i * most for i in range(n)])
    return valid[_order(g, device)], most


def etp_gather(x: torch.Tensor, g: Splits, group: Group, fwd: Window, bwd: Window) -> torch.Tensor:
    """This rank's received copies (source-major) -> every ETP rank's, grouped by local expert: one all-gather of
    padded equal blocks (backward: the reduce-scatter of the partial gradients each ETP rank's columns give)."""
    n = tp.world(group)
    pos, most = _padded_positions(g, n, x.device)
    padded = torch.cat([x, x.new_zeros((most - x.shape[0], *x.shape[1:]))])
    return tp.gather_from_sp(padded, group, fwd, bwd)[pos]


def etp_reduce_scatter(y: torch.Tensor, g: Splits, group: Group, fwd: Window, bwd: Window) -> torch.Tensor:
    """The experts' partial outputs for every ETP rank's copies (grouped by local expert) -> this rank's own copies
    (source-major), summed over the ETP ranks' FC2 rows: one reduce-scatter of padded equal blocks (backward: the
    all-gather)."""
    n = tp.world(group)
    pos, most = _padded_positions(g, n, y.device)
    padded = y.new_zeros((n * most, *y.shape[1:])).index_copy(0, pos, y)
    own = _rows(g, n)[tp.rank_in(group)]
    return tp.reduce_scatter_to_sp(padded, group, fwd, bwd)[:own]


def unpermute(y: torch.Tensor, router_out: torch.Tensor, k: int) -> torch.Tensor:
    """The copies `y` (sorted by expert) weighted by their router probability and summed per token: [tok, h].

    What autograd saves is Megatron's (moe_utils.unpermute: the copies, the probabilities, the indices): `y`
    itself (the combine's output, an op the plan prices), the gathered probabilities and two int64 index
    vectors. Not `index_add`: its backward saves the whole weighted source, one more tok x k x h tensor per
    layer and micro-batch that no plan prices (docs/decisions/0225)."""
    probs, ids = route(router_out, k)
    order = sort_by_expert(ids)
    inv = torch.empty_like(order)  # copy j of the token-major layout sits at row inv[j] of y
    inv[order] = torch.arange(order.numel(), device=order.device)
    weighted = y * probs.reshape(-1)[order].to(y.dtype)[:, None]
    return weighted[inv].view(probs.shape[0], k, y.shape[-1]).sum(1)


def expert_gemm(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of x grouped by local expert (counts[e] rows each) times that expert's weight w[e] ([in, out])."""
    parts = [xe @ w[e] for e, xe in enumerate(torch.split(x, counts))]
    return torch.cat(parts) if parts else x.new_empty((0, w.shape[-1]))
