"""The layer splits stock Megatron-Core can be told to run, in its own knobs: the even split,
``--account-for-embedding/loss-in-pipeline-split`` (the embedding / loss counted as one more layer, so the
first / last virtual stage builds one layer fewer) and ``--decoder-first/last-pipeline-num-layers`` (given ends,
the rest evenly over the middle stages). Megatron-Core 0.16.1's `get_num_layers_to_build` and
`TransformerConfig.__post_init__` (megatron/core/transformer/transformer_block.py, transformer_config.py) decide
which are valid: with interleaving every stage's layers divide by VPP, the two families of knobs exclude each
other, and no virtual stage is left empty (lynx's `Partition` needs a layer per virtual stage).

A split is enumerated only where it changes something: the even split when it exists, the embedding / loss
variants, and first / last stages lighter than the middle ones around the balanced middle size (126-layer
Llama-3.1-405B over 16 stages: 7 + 14 x 8 + 7, Meta's layout; over 8 x 8 virtual stages with both account-for
flags: NVIDIA's)."""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Split:
    """One of Megatron-Core's splits (all defaults: the even split)."""

    first: int | None = None
    """--decoder-first-pipeline-num-layers"""
    last: int | None = None
    """--decoder-last-pipeline-num-layers"""
    embedding: bool = False
    """--account-for-embedding-in-pipeline-split"""
    loss: bool = False
    """--account-for-loss-in-pipeline-split"""

    @property
    def even(self) -> bool:
        return self == EVEN

    def key(self) -> tuple[int, int, bool, bool]:
        """A sort key (None sorts as -1: the knob not given)."""
        return (-1 if self.first is None else self.first, -1 if self.last is None else self.last, self.embedding,
                self.loss)

    def flags(self) -> str:
        """The Megatron flags that give this split ('' for the even one)."""
        out = []
        if self.first is not None:
            out.append(f"--decoder-first-pipeline-num-layers {self.first}")
        if self.last is not None:
            out.append(f"--decoder-last-pipeline-num-layers {self.last}")
        if self.embedding:
            out.append("--account-for-embedding-in-pipeline-split")
        if self.loss:
            out.append("--account-for-loss-in-pipeline-split")
        return " ".join(out)

    def label(self) -> str:
        """Short form for tables: 'even', 'first 7 last 7', '+emb +loss'."""
        if self.even:
            return "even"
        parts = []
        if self.first is not None:
            parts.append(f"first {self.first}")
        if self.last is not None:
            parts.append(f"last {self.last}")
        if self.embedding:
            parts.append("+emb")
        if self.loss:
            parts.append("+loss")
        return " ".join(parts)


EVEN = Split()


def chunks(split: Split, layers: int, pp: int, vpp: int) -> tuple[int, ...] | None:
    """Layers per virtual stage in model order (virtual stage k = chunk * PP + rank) as Megatron-Core builds them,
    or None where Megatron-Core refuses the split (or leaves a virtual stage empty)."""
    if (split.first is not None or split.last is not None) and (split.embedding or split.loss):
        return None
    if split.first is not None or split.last is not None:
        per_rank = _ends(split, layers, pp, vpp)
    else:
        total = layers + split.embedding + split.loss
        if total % pp:
            return None
        per_rank = [total // pp] * pp
    if per_rank is None or any(n % vpp for n in per_rank):
        return None
    out = [per_rank[r] // vpp for _ in range(vpp) for r in range(pp)]
    out[0] -= split.embedding
    out[-1] -= split.loss
    return tuple(out) if min(out) >= 1 else None


def _ends(split: Split, layers: int, pp: int, vpp: int) -> list[int] | None:
    middle = pp - (split.first is not None) - (split.last is not None)
    rest = layers - (split.first or 0) - (split.last or 0)
    if rest < 0 or (middle == 0 and rest) or (middle > 0 and (rest == 0 or rest % middle)):
        return None
    each = rest // middle if middle else 0
    out = [each] * pp
    if split.first is not None:
        out[0] = split.first
    if split.last is not None:
        out[-1] = split.last
    return out if min(out) >= 1 else None


@functools.lru_cache(maxsize=4096)
def stock_splits(layers: int, pp: int, vpp: int) -> tuple[Split, ...]:
    """The splits stock Megatron-Core candidates are priced on for (PP, VPP): each distinct valid layout once,
    the even split first."""
    options = [EVEN, Split(embedding=True), Split(loss=True), Split(embedding=True, loss=True)]
    if pp >= 2:
        ceil = -(-layers // pp)
        base = -(-ceil // vpp) * vpp  # the balanced middle size, rounded up to whole chunks
        for m in (base, base + vpp):  # and one chunk more: lighter ends
            ends = layers - (pp - 2) * m  # first + last with both given
            for f in range(vpp, m + 1, vpp):  # lighter (or equal) ends: what these knobs are for
                last = ends - f
                if vpp <= last <= m and abs(f - last) <= vpp:
                    options.append(Split(first=f, last=last))
            lone = layers - (pp - 1) * m
            if vpp <= lone < m:
                options += [Split(first=lone), Split(last=lone)]
    seen: dict[tuple[int, ...], Split] = {}
    for s in options:
        c = chunks(s, layers, pp, vpp)
        if c is not None and c not in seen:
            seen[c] = s
    return tuple(seen.values())
