"""The two ends of a language model around its layer stack: the embedding (first pipeline stage) and the
final norm with the LM head (last stage). Each family's runtime module gives one `ModelEnds`; the
single-process models and the pipeline's stages build theirs through it, so a pipeline's stages together
are the single-process model, parameter for parameter (same names, same values)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from lynx.runtime.layers.tp import Group


class ModelEnds(Protocol):
    """How one family builds and runs the ends of its model on a module that owns the parameters (the
    single-process model or a pipeline stage: a `torch.nn.Module` with the layer config as `cfg` and the
    weight seed as `seed`)."""

    @property
    def first_params(self) -> tuple[str, ...]:
        """Parameter-name prefixes the first stage holds (its embedding)."""
        ...

    @property
    def last_params(self) -> tuple[str, ...]:
        """Parameter-name prefixes the last stage holds (its final norm and head)."""
        ...

    @property
    def tied(self) -> tuple[str, ...]:
        """Parameters both ends hold (a tied embedding / head): their gradient is the sum of the two stages'."""
        ...

    def build(self, owner: Any, cfg: Any, vocab_size: int, seed: int, first: bool, last: bool,
              device: Any) -> None:
        """Register the first stage's and / or the last stage's parameters on `owner`."""
        ...

    def embed(self, owner: Any, tokens: torch.Tensor, microbatch: int, group: Group) -> torch.Tensor:
        """tokens [b, s] -> hidden [s, b, h] (with sequence parallelism: this rank's [s/t, b, h])."""
        ...

    def head(self, owner: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        """hidden [s, b, h] (or this rank's sequence shard) -> this TP rank's logits [s, b, V / t] (the head
        is vocabulary-parallel, `lynx.runtime.layers.vocab`)."""
        ...


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Mean next-token cross-entropy; logits [s, b, V / t] sharded over the TP `group` (None: the whole
    vocabulary), labels [b, s]."""
    from lynx.runtime.layers.vocab import cross_entropy

    return cross_entropy(logits, labels, group)
