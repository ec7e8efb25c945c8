"""The GPT model around its layers: token and position embeddings (+ dropout), a stack of `GPTLayer`s,
final LayerNorm, LM head tied to the token embedding, loss.

The word embedding and the (tied) LM head are vocabulary-parallel over TP (`layers.vocab`, as Megatron-Core's
`VocabParallelEmbedding`): each rank holds V / t rows, the lookups meet in an all-reduce, the logits are
[s, b, V / t] per rank and the loss is the vocabulary-parallel cross-entropy, as the planner prices them. The
position embedding is replicated. With sequence parallelism the embedding output is split along the sequence
before its dropout (Megatron-Core's order, so the mask is s b h / t) and gathered before the final LayerNorm,
and the LayerNorm weight gradients, which are partial per rank, are all-reduced by `allreduce_sp_grads`.

The layer stack runs either plainly (`engine=None`, every activation kept by autograd: the reference) or
through a `RecomputeEngine`. A pipeline stage builds its ends through `GPT_ENDS` exactly as this model does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from lynx.runtime.engine import RecomputeEngine
from lynx.runtime.layers import tp, vocab
from lynx.runtime.layers.ends import lm_loss
from lynx.runtime.layers.family import RuntimeFamily
from lynx.runtime.layers.gpt import GPTLayer, LayerConfig, op_names_for
from lynx.runtime.layers.tp import Group
from lynx.spec import ModelSpec, ParallelSpec

__all__ = ["GPTModel", "GPT_ENDS", "lm_loss", "synthetic_batch"]


@dataclass(frozen=True)
class GPTEnds:
    """Token + position embedding with dropout; final LayerNorm and the head tied to the token embedding."""

    first_params: tuple[str, ...] = ("wte", "wpe")
    last_params: tuple[str, ...] = ("wte", "ln_f.")
    tied: tuple[str, ...] = ("wte",)

    def build(self, owner: Any, cfg: LayerConfig, vocab_size: int, seed: int, first: bool,
              last: bool, device: Any) -> None:
        if not (first or last):
            return
        wte, wpe = embedding_weights(cfg, vocab_size, seed)
        owner.vocab_size = vocab_size
        wte = vocab.shard_rows(wte, getattr(owner, "group", None))  # this TP rank's rows (vocabulary-parallel)
        owner.wte = torch.nn.Parameter(wte.to(device=device, dtype=cfg.dtype))
        if first:
            owner.wpe = torch.nn.Parameter(wpe.to(device=device, dtype=cfg.dtype))
        if last:  # the LM head is tied to `wte`, as ModelSpec counts it
            owner.ln_f = torch.nn.LayerNorm(cfg.hidden_size, device=device, dtype=cfg.dtype)

    def embed(self, owner: Any, tokens: torch.Tensor, microbatch: int, group: Group) -> torch.Tensor:
        return embed(owner.wte, owner.wpe, tokens, microbatch, owner.cfg, owner.seed,
                     owner.training, group, owner.vocab_size)

    def head(self, owner: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ln_f: torch.nn.Module = owner.ln_f
        return head_logits(x, ln_f, owner.wte, owner.cfg, group)


GPT_ENDS = GPTEnds()


class GPTModel(torch.nn.Module):
    def __init__(self, cfg: LayerConfig, num_layers: int, vocab_size: int, group: Group = None,
                 device: torch.device | str | None = None, seed: int = 1234) -> None:
        super().__init__()
        cfg = replace(cfg, num_layers=num_layers)
        self.cfg, self.group, self.seed = cfg, group, seed
        GPT_ENDS.build(self, cfg, vocab_size, seed, True, True, device)
        self.layers = torch.nn.ModuleList(
            GPTLayer(cfg, group, layer_index=i, device=device, seed=seed) for i in range(num_layers)
        )

    def embed(self, tokens: torch.Tensor, microbatch: int) -> torch.Tensor:
        """tokens [b, s] -> [s, b, h] (with SP: this rank's [s/t, b, h])."""
        return GPT_ENDS.embed(self, tokens, microbatch, self.group)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, microbatch: int = 0,
                engine: RecomputeEngine | None = None) -> torch.Tensor:
        """Mean cross-entropy over the micro-batch's tokens."""
        x = self.embed(tokens, microbatch)
        if engine is not None:
            x = engine.forward(x, microbatch)
        else:
            for layer in self.layers:
                x = layer(x, microbatch)
        return lm_loss(GPT_ENDS.head(self, x, self.group), labels, self.group)

    def allreduce_sp_grads(self) -> None:
        """Sum the partial LayerNorm gradients of the sequence-parallel region over the TP group."""
        tp.allreduce_sp_grads(self, self.cfg.sequence_parallel, self.group)


def embedding_weights(cfg: LayerConfig, vocab_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token and position embeddings (float32, CPU), drawn in this order from one seeded generator: a
    pipeline's first stage builds the same tensors as the whole model."""
    g = torch.Generator().manual_seed(seed)
    wte = torch.empty(vocab_size, cfg.hidden_size).normal_(0, 0.02, generator=g)
    wpe = torch.empty(cfg.seq_length, cfg.hidden_size).normal_(0, 0.02, generator=g)
    return wte, wpe


def embed(wte: torch.Tensor, wpe: torch.Tensor, tokens: torch.Tensor, microbatch: int, cfg: LayerConfig,
          seed: int, training: bool, group: Group, vocab_size: int | None = None) -> torch.Tensor:
    """tokens [b, s] -> [s, b, h] (with SP: this rank's [s/t, b, h]); `wte` is this TP rank's rows of the
    word embedding (`vocab_size` rows in all; None: `wte` is the whole matrix, TP = 1); dropout seeded by
    micro-batch, the same mask on every rank (with SP each rank applies its slice of it)."""
    v = wte.shape[0] * tp.world(group) if vocab_size is None else vocab_size
    x = vocab.embed_tokens(wte, tokens, v, group, False) + wpe[: tokens.shape[1]].unsqueeze(1)
    if cfg.sequence_parallel:
        x = tp.apply_fn(tp.SplitSeqFn, x, group, False)
    p = cfg.dropout_p
    if training and p > 0:
        gen = torch.Generator(device=x.device).manual_seed(seed * 7919 + microbatch)
        shape = (tokens.shape[1], *x.shape[1:])
        mask = torch.empty(shape, dtype=torch.bool, device=x.device).bernoulli_(1 - p, generator=gen)
        if cfg.sequence_parallel:
            mask = mask.chunk(tp.world(group), 0)[tp.rank_in(group)]
        x = x * mask * (1.0 / (1.0 - p))
    return x


def head_logits(x: torch.Tensor, ln_f: torch.nn.Module, wte: torch.Tensor, cfg: LayerConfig,
                group: Group) -> torch.Tensor:
    """The final LayerNorm and the tied, vocabulary-parallel LM head: [s, b, h] (with SP this rank's
    sequence shard) -> this rank's logits [s, b, V / t]."""
    if cfg.sequence_parallel:
        x = tp.apply_fn(tp.SplitSeqFn, x, group, True)
    return vocab.head_logits(tp.call(ln_f, x), wte, group)


def synthetic_batch(vocab: int, micro_batch: int, seq: int, microbatch: int, seed: int = 0,
                    device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic random tokens (identical on every rank) and next-token labels."""
    g = torch.Generator().manual_seed(seed * 100003 + microbatch)
    t = torch.randint(0, vocab, (micro_batch, seq + 1), generator=g)
    return t[:, :-1].to(device), t[:, 1:].to(device)


def _config(model: ModelSpec, par: ParallelSpec, dtype: torch.dtype, core_attn: bool) -> LayerConfig:
    return LayerConfig(
        hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=model.ffn_hidden_size, seq_length=par.seq_length, micro_batch_size=par.micro_batch_size,
        tp=par.tp, sequence_parallel=par.sequence_parallel,
        dropout_p=model.hidden_dropout if model.dropout else 0.0, dtype=dtype,
        core_attn=core_attn or model.attention == "flash", num_layers=model.num_layers,
    )


RUNTIME = RuntimeFamily(config=_config, layer=GPTLayer, model=GPTModel, op_names=op_names_for, ends=GPT_ENDS)
