"""A GPT model for the runtime: embeddings, a stack of `GPTLayer`s, final LayerNorm, LM head, loss.

The embedding and the (tied) LM head are replicated on every TP rank (vocab-parallel embeddings are not implemented:
they change no recomputation decision, only the size of the head). With sequence parallelism the
embedding output is split along the sequence before the first layer and gathered after the last, and the
LayerNorm weight gradients, which are partial per rank, are all-reduced by `allreduce_sp_grads`.

The layer stack runs either plainly (`engine=None`, every activation kept by autograd: the reference) or
through a `RecomputeEngine`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lynx.runtime.engine import RecomputeEngine
from lynx.runtime.layers import tp
from lynx.runtime.layers.family import RuntimeFamily
from lynx.runtime.layers.gpt import GPTLayer, LayerConfig, op_names_for
from lynx.spec import ModelSpec, ParallelSpec


class GPTModel(torch.nn.Module):
    def __init__(self, cfg: LayerConfig, num_layers: int, vocab_size: int, group: Any = None,
                 device: Any = None, seed: int = 1234) -> None:
        super().__init__()
        cfg = replace(cfg, num_layers=num_layers)
        self.cfg, self.group, self.seed = cfg, group, seed
        h = cfg.hidden_size
        kw = {"device": device, "dtype": cfg.dtype}
        wte, wpe = embedding_weights(cfg, vocab_size, seed)
        self.wte = torch.nn.Parameter(wte.to(**kw))
        self.wpe = torch.nn.Parameter(wpe.to(**kw))
        self.layers = torch.nn.ModuleList(
            GPTLayer(cfg, group, layer_index=i, device=device, seed=seed) for i in range(num_layers)
        )
        self.ln_f = torch.nn.LayerNorm(h, **kw)  # the LM head is tied to `wte`, as ModelSpec counts it

    def embed(self, tokens: torch.Tensor, microbatch: int) -> torch.Tensor:
        """tokens [b, s] -> [s, b, h] (with SP: this rank's [s/t, b, h])."""
        return embed(self.wte, self.wpe, tokens, microbatch, self.cfg, self.seed, self.training, self.group)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, microbatch: int = 0,
                engine: RecomputeEngine | None = None) -> torch.Tensor:
        """Mean cross-entropy over the micro-batch's tokens."""
        x = self.embed(tokens, microbatch)
        if engine is not None:
            x = engine.forward(x, microbatch)
        else:
            for layer in self.layers:
                x = layer(x, microbatch)
        return lm_loss(head_logits(x, self.ln_f, self.wte, self.cfg, self.group), labels)

    def allreduce_sp_grads(self) -> None:
        """Sum the partial LayerNorm gradients of the sequence-parallel region over the TP group."""
        if not self.cfg.sequence_parallel or tp.world(self.group) == 1:
            return
        for p in self.parameters():
            if getattr(p, "sequence_parallel", False) and p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)


def embedding_weights(cfg: LayerConfig, vocab_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token and position embeddings (float32, CPU), drawn in this order from one seeded generator: a
    pipeline's first stage builds the same tensors as the whole model."""
    g = torch.Generator().manual_seed(seed)
    wte = torch.empty(vocab_size, cfg.hidden_size).normal_(0, 0.02, generator=g)
    wpe = torch.empty(cfg.seq_length, cfg.hidden_size).normal_(0, 0.02, generator=g)
    return wte, wpe


def embed(wte: torch.Tensor, wpe: torch.Tensor, tokens: torch.Tensor, microbatch: int, cfg: LayerConfig,
          seed: int, training: bool, group: Any) -> torch.Tensor:
    """tokens [b, s] -> [s, b, h] (with SP: this rank's [s/t, b, h]); dropout seeded by micro-batch."""
    x = (wte[tokens] + wpe[: tokens.shape[1]]).transpose(0, 1).contiguous()
    p = cfg.dropout_p
    if training and p > 0:
        gen = torch.Generator(device=x.device).manual_seed(seed * 7919 + microbatch)
        mask = torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(1 - p, generator=gen)
        x = x * mask * (1.0 / (1.0 - p))
    if cfg.sequence_parallel:
        x = tp.SplitSeqFn.apply(x, group, False)
    return x


def head_logits(x: torch.Tensor, ln_f: torch.nn.Module, wte: torch.Tensor, cfg: LayerConfig,
                group: Any) -> torch.Tensor:
    """The final LayerNorm and the tied LM head: [s, b, h] -> logits [s, b, V]."""
    if cfg.sequence_parallel:
        x = tp.SplitSeqFn.apply(x, group, True)
    return F.linear(ln_f(x), wte)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; labels [b, s]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.transpose(0, 1).flatten())


def synthetic_batch(vocab: int, micro_batch: int, seq: int, microbatch: int, seed: int = 0,
                    device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
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


RUNTIME = RuntimeFamily(config=_config, layer=GPTLayer, model=GPTModel, op_names=op_names_for)
