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

from lynx.runtime import tp
from lynx.runtime.engine import RecomputeEngine
from lynx.runtime.family import RuntimeFamily
from lynx.runtime.layer import GPTLayer, LayerConfig, op_names_for
from lynx.spec import ModelSpec, ParallelSpec


class GPTModel(torch.nn.Module):
    def __init__(self, cfg: LayerConfig, num_layers: int, vocab_size: int, group: Any = None,
                 device: Any = None, seed: int = 1234) -> None:
        super().__init__()
        cfg = replace(cfg, num_layers=num_layers)
        self.cfg, self.group, self.seed = cfg, group, seed
        h = cfg.hidden_size
        g = torch.Generator().manual_seed(seed)
        kw = {"device": device, "dtype": cfg.dtype}
        self.wte = torch.nn.Parameter(torch.empty(vocab_size, h).normal_(0, 0.02, generator=g).to(**kw))
        self.wpe = torch.nn.Parameter(torch.empty(cfg.seq_length, h).normal_(0, 0.02, generator=g).to(**kw))
        self.layers = torch.nn.ModuleList(
            GPTLayer(cfg, group, layer_index=i, device=device, seed=seed) for i in range(num_layers)
        )
        self.ln_f = torch.nn.LayerNorm(h, **kw)  # the LM head is tied to `wte`, as ModelSpec counts it

    def embed(self, tokens: torch.Tensor, microbatch: int) -> torch.Tensor:
        """tokens [b, s] -> [s, b, h] (with SP: this rank's [s/t, b, h])."""
        x = (self.wte[tokens] + self.wpe[: tokens.shape[1]]).transpose(0, 1).contiguous()
        p = self.cfg.dropout_p
        if self.training and p > 0:
            gen = torch.Generator(device=x.device).manual_seed(self.seed * 7919 + microbatch)
            mask = torch.empty(x.shape, dtype=torch.bool, device=x.device).bernoulli_(1 - p, generator=gen)
            x = x * mask * (1.0 / (1.0 - p))
        if self.cfg.sequence_parallel:
            x = tp.SplitSeqFn.apply(x, self.group, False)
        return x

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, microbatch: int = 0,
                engine: RecomputeEngine | None = None) -> torch.Tensor:
        """Mean cross-entropy over the micro-batch's tokens."""
        x = self.embed(tokens, microbatch)
        if engine is not None:
            x = engine.forward(x, microbatch)
        else:
            for layer in self.layers:
                x = layer(x, microbatch)
        if self.cfg.sequence_parallel:
            x = tp.SplitSeqFn.apply(x, self.group, True)
        logits = F.linear(self.ln_f(x), self.wte)  # [s, b, V]
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.transpose(0, 1).flatten())

    def allreduce_sp_grads(self) -> None:
        """Sum the partial LayerNorm gradients of the sequence-parallel region over the TP group."""
        if not self.cfg.sequence_parallel or tp.world(self.group) == 1:
            return
        for p in self.parameters():
            if getattr(p, "sequence_parallel", False) and p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)


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
