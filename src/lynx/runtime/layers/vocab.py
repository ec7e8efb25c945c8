"""The vocabulary split over tensor parallelism, as the planner prices it (`families.gpt.embedding_params`:
V h / t per rank; `memory.extra_transient_bytes`: logits of s b V / t per rank): a vocabulary-parallel word
embedding and LM head, and the cross-entropy computed on vocabulary-sharded logits.

The behaviour follows Megatron-Core's `VocabParallelEmbedding` and `vocab_parallel_cross_entropy`
(megatron/core/tensor_parallel/layers.py, cross_entropy.py); the code is lynx's own:

- rank r of t owns the rows [r V / t, (r + 1) V / t) of the word embedding (the full matrix is drawn from the
  same generator on every rank and sliced, so a TP = 2 model is the TP = 1 model split);
- the embedding looks up the tokens this rank owns, zeroes the others, and the partial sums meet in an
  all-reduce over TP (a reduce-scatter along the sequence with sequence parallelism); its backward is the
  identity (resp. an all-gather), so each rank's shard gets the gradient of its own rows;
- the head is `copy_to_tp` (backward: all-reduce of the input gradient) and a linear with this rank's rows:
  each rank holds logits [s, b, V / t];
- the cross-entropy takes the maximum over the vocabulary with an all-reduce MAX, the target's logit and the
  sum of exponentials with all-reduces SUM, and keeps only the softmax of its own shard (fp32) for backward:
  softmax minus one-hot on the target, which lives on one rank.

With a one-rank group (TP = 1) nothing is split and the loss is `torch.nn.functional.cross_entropy`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lynx.runtime.layers import tp
from lynx.runtime.layers.tp import Group


def vocab_range(vocab_size: int, group: Group) -> tuple[int, int]:
    """[start, end) of the vocabulary rows this rank owns."""
    n, r = tp.world(group), tp.rank_in(group)
    if vocab_size % n:
        raise ValueError(f"vocabulary-parallel embedding: vocabulary {vocab_size} not divisible by TP={n} "
                         f"(Megatron pads it: --make-vocab-size-divisible-by)")
    per = vocab_size // n
    return r * per, (r + 1) * per


def shard_rows(full: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's rows of a full [V, h] embedding matrix (a copy, contiguous)."""
    a, b = vocab_range(full.shape[0], group)
    return full[a:b].clone()


def embed_tokens(weight: torch.Tensor, tokens: torch.Tensor, vocab_size: int, group: Group,
                 reduce_scatter: bool) -> torch.Tensor:
    """tokens [b, s] -> [s, b, h] from this rank's rows `weight` [V / t, h]: the partial lookup summed over
    TP, or with `reduce_scatter` reduce-scattered along the sequence (this rank's [s / t, b, h]; Megatron-Core
    does so with sequence parallelism when no position embedding is added after the lookup)."""
    if tp.world(group) == 1:
        x = weight[tokens].transpose(0, 1).contiguous()
        return tp.apply_fn(tp.SplitSeqFn, x, group, False) if reduce_scatter else x
    a, b = vocab_range(vocab_size, group)
    outside = (tokens < a) | (tokens >= b)
    local = (tokens - a).masked_fill(outside, 0)
    part = weight[local].masked_fill(outside.unsqueeze(-1), 0.0).transpose(0, 1).contiguous()
    if reduce_scatter:
        return tp.reduce_scatter_to_sp(part, group)
    return tp.reduce_from_tp(part, group)


def head_logits(x: torch.Tensor, weight: torch.Tensor, group: Group) -> torch.Tensor:
    """Normalized hidden [s, b, h] (replicated over TP) -> this rank's logits [s, b, V / t]."""
    return torch.nn.functional.linear(tp.copy_to_tp(x, group), weight)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy of vocabulary-sharded logits [n, V / t] against targets [n] (global ids)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Group) -> torch.Tensor:
        a = tp.rank_in(group) * logits.shape[-1]
        b = a + logits.shape[-1]
        # one fp32 working copy (Megatron's logits.float()), then everything in place on it
        work = logits.to(torch.float32, copy=True)
        top = work.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        work.sub_(top.unsqueeze(-1))
        outside = (target < a) | (target >= b)
        local = (target - a).masked_fill(outside, 0)
        rows = torch.arange(work.shape[0], device=work.device)
        picked = work[rows, local].masked_fill(outside, 0.0)
        dist.all_reduce(picked, group=group)
        work.exp_()
        total = work.sum(dim=-1)
        dist.all_reduce(total, group=group)
        work.div_(total.unsqueeze(-1))  # now this shard's softmax, the only large tensor backward reads
        ctx.save_for_backward(work, local, outside)
        ctx.in_dtype = logits.dtype
        return total.log() - picked

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        softmax, local, outside = ctx.saved_tensors
        grad = softmax  # in place, as Megatron-Core does: no second s b V / t fp32 buffer (one backward only)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= (~outside).to(grad.dtype)
        grad.mul_(g.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group: Group = None,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of logits [s, b, V / t] (this rank's vocabulary shard) against labels
    [b, s]; every rank of the TP group returns the same loss. `mask` [b, s] (0 or 1): the mean over the tokens
    it keeps (Megatron's loss mask)."""
    flat, target = logits.flatten(0, 1), labels.transpose(0, 1).flatten()
    if tp.world(group) == 1:
        if mask is None:
            return torch.nn.functional.cross_entropy(flat.float(), target)
        per_token = torch.nn.functional.cross_entropy(flat.float(), target, reduction="none")
    else:
        per_token = tp.apply_fn(_VocabParallelCE, flat, target, group)
        if mask is None:
            return per_token.mean()
    keep = mask.transpose(0, 1).flatten().to(per_token.dtype)
    return (per_token * keep).sum() / keep.sum()
