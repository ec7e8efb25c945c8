"""DeepSeek-V3's multi-token prediction on the last pipeline stage, as Megatron-Core's MultiTokenPredictionBlock
runs it (megatron/core/transformer/multi_token_prediction.py and GPTModel's `_postprocess`, 0.16; `--mtp-num-layers
D`, `--mtp-loss-scaling-factor`). The code is lynx's own.

Depth k = 1 .. D, from the decoder's output h_0 after the final norm (the main head's input):

- the token ids and the labels move one position left (the last position filled with 0), and so does a loss mask
  that starts at ones (Megatron's `roll_tensor`): depth k predicts the token k + 1 places ahead;
- e_k = RMSNorm_e(embedding(ids)) with the model's word embedding (on a last stage that is not the first, a copy
  whose gradient is summed with the first stage's, as a tied embedding's), and RMSNorm_h(h_(k-1));
- h_k = RMSNorm_out(layer_k(eh_proj([e_k ; h_(k-1)]))): eh_proj a column-parallel 2h -> h linear whose output is
  gathered over TP (the input all-gathered along the sequence first with SP, the output scattered back to
  it), layer_k a layer of the kind of the model's last layer;
- loss_k = the masked mean cross-entropy of the shared LM head's logits of h_k against the rolled labels.

The training objective per micro-batch is the main loss plus `mtp_loss_scaling_factor / D x sum_k loss_k`; the
pipeline's last stage attaches the MTP term to its logits (`AttachLoss`, Megatron's MTPLossAutoScaler), so the
schedule's loss function and its backward are unchanged. The MTP layer runs outside the recompute engine (the
planner prices it as kept on the last stage, `lynx.cost.memory.mtp_bytes`)."""

from __future__ import annotations

from typing import Any

import torch

from lynx.runtime.layers import tp, vocab
from lynx.runtime.layers.tp import Group


def roll_left(t: torch.Tensor) -> torch.Tensor:
    """[b, s] one position left along the sequence, the last position 0 (Megatron's roll_tensor without CP)."""
    out = torch.roll(t, -1, dims=-1)
    out[..., -1] = 0
    return out


class AttachLoss(torch.autograd.Function):
    """Returns `out` unchanged; its backward also starts the backward of the scalar `aux` with gradient `scale`
    (the weight the main loss's own backward gets: 1 / the number of micro-batches)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        (aux,) = ctx.saved_tensors
        return g, torch.full_like(aux, ctx.scale), None


class _GatherHidden(torch.autograd.Function):
    """All-gather the last dimension over TP (Megatron's gather_from_tensor_model_parallel_region); backward keeps
    this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        full = tp.run_collective("allgather", x.movedim(-1, 0).contiguous(), group)
        return full.movedim(0, -1).contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return g.chunk(tp.world(ctx.group), -1)[tp.rank_in(ctx.group)].contiguous(), None


class MtpDepth(torch.nn.Module):
    """One MTP layer's parameters: the two input norms, eh_proj (this TP rank's rows), the layer, the output norm."""

    def __init__(self, cfg: Any, layer: torch.nn.Module, group: Group, seed: int, device: Any,
                 norm_fn: type[torch.autograd.Function]) -> None:
        super().__init__()
        self._norm_fn = norm_fn
        h, kw = cfg.hidden_size, {"device": device, "dtype": cfg.dtype}
        self.cfg, self.group = cfg, group
        self.enorm = torch.nn.Parameter(torch.ones(h, **kw))
        self.hnorm = torch.nn.Parameter(torch.ones(h, **kw))
        self.out_norm = torch.nn.Parameter(torch.ones(h, **kw))
        if cfg.sequence_parallel:  # applied to this rank's tokens: partial gradients, summed over TP by the runner
            for p in (self.enorm, self.hnorm, self.out_norm):
                p.sequence_parallel = True  # type: ignore[attr-defined]
        self.eh_proj = tp.ColumnParallelLinear(2 * h, h, group, seed=seed, **kw)
        self.eh_proj.bias = None  # type: ignore[assignment]  # Megatron's eh_proj has no bias
        self.layer = layer

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return tp.apply_fn(self._norm_fn, x, w, self.cfg.norm_eps)

    def forward(self, hidden: torch.Tensor, emb: torch.Tensor, mb: int) -> torch.Tensor:
        """hidden, emb: [s, b, h] (this rank's [s/t, b, h] with SP) -> the depth's output, same layout."""
        x = torch.cat((self.norm(emb, self.enorm), self.norm(hidden, self.hnorm)), -1)
        sp, group = self.cfg.sequence_parallel, self.group
        x = tp.gather_from_sp(x, group) if sp else tp.copy_to_tp(x, group)
        y = tp.apply_fn(tp.ColumnParallelLinearFn, x, self.eh_proj.weight, None, None, None)
        if tp.world(group) > 1:
            y = tp.apply_fn(_GatherHidden, y, group)
        if sp:
            y = tp.apply_fn(tp.SplitSeqFn, y, group, False)
        return self.norm(self.layer(y, mb), self.out_norm)


class MultiTokenPrediction(torch.nn.Module):
    """The D MTP layers of a last stage (`depths`), and the main head with the MTP losses (`head`)."""

    def __init__(self, cfg: Any, depths: list[MtpDepth], scaling: float,
                 norm_fn: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.cfg, self._norm_fn = cfg, norm_fn
        self.depths = torch.nn.ModuleList(depths)
        self.weight = scaling / len(depths)
        self.losses: list[list[float]] = []
        """Per micro-batch of the step, each depth's mean loss (Megatron logs them as "mtp_k loss")."""

    def head(self, owner: Any, ends: Any, x: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor,
             group: Group, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's output `x` on `owner` (which holds the embedding, the final norm and the head) -> the main
        logits and the weighted MTP loss."""
        sp = self.cfg.sequence_parallel
        full = tp.apply_fn(tp.SplitSeqFn, x, group, True) if sp else x
        normed = tp.apply_fn(self._norm_fn, full, owner.norm_f, self.cfg.norm_eps)
        logits = vocab.head_logits(normed, owner.head, group)
        hidden = tp.apply_fn(tp.SplitSeqFn, normed, group, False) if sp else normed
        ids, lab, mask = tokens, labels, torch.ones_like(labels)
        losses = []
        for depth in self.depths:
            ids, lab, mask = roll_left(ids), roll_left(lab), roll_left(mask)
            hidden = depth(hidden, ends.embed(owner, ids, mb, group), mb)
            h_full = tp.apply_fn(tp.SplitSeqFn, hidden, group, True) if sp else hidden
            losses.append(vocab.cross_entropy(vocab.head_logits(h_full, owner.head, group), lab, group, mask))
        self.losses.append([float(v.detach()) for v in losses])
        return logits, self.weight * torch.stack(losses).sum()


def build(cfg: Any, layer: Any, group: Group, device: Any, seed: int,
          norm_fn: type[torch.autograd.Function]) -> MultiTokenPrediction | None:
    """The last stage's MTP block (None without MTP layers): `layer(index)` builds the layer at global index
    `index` (num_layers + k: its weights drawn from its own seeds); `norm_fn(x, weight, eps)` is the family's
    RMSNorm."""
    if not getattr(cfg, "mtp_layers", 0):
        return None
    n = cfg.num_layers
    depths = [MtpDepth(cfg, layer(n + k), group, seed * 1000 + (n + k) * 10 + 8, device, norm_fn)
              for k in range(cfg.mtp_layers)]
    return MultiTokenPrediction(cfg, depths, cfg.mtp_scale, norm_fn)


__all__ = ["AttachLoss", "MtpDepth", "MultiTokenPrediction", "build", "roll_left"]
