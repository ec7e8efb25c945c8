"""The model's layer stack as kinds: which of its layers are dense and which mixture-of-experts.

Megatron-Core's ``--moe-layer-freq`` decides it (TransformerConfig.moe_layer_freq; megatron/core/models/gpt/
gpt_layer_specs.py, ``get_gpt_decoder_block_spec``): an integer N makes layer i (from 0) an MoE layer when
i % N == 0, a list gives one 0 (dense) or 1 (MoE) per layer (DeepSeek-V3: three dense layers, then 58 MoE).
A dense model (no experts) is all dense. Data only: no family, no hardware (docs/decisions/0220).
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

from lynx.spec import ModelSpec

LayerKind = Literal["dense", "moe"]
KINDS: tuple[LayerKind, ...] = ("dense", "moe")


def layer_kinds(m: ModelSpec) -> tuple[LayerKind, ...]:
    """One kind per decoder layer, bottom first (the MTP layers after the decoder are not in it)."""
    moe: LayerKind = "moe"
    dense: LayerKind = "dense"
    if not m.is_moe:
        return (dense,) * m.num_layers
    if m.moe_layer_pattern:
        return tuple(moe if x else dense for x in m.moe_layer_pattern)
    return tuple(moe if i % m.moe_layer_freq == 0 else dense for i in range(m.num_layers))


def kinds_present(m: ModelSpec) -> tuple[LayerKind, ...]:
    """The distinct kinds of the model's layers, in `KINDS` order."""
    seen = set(layer_kinds(m))
    return tuple(k for k in KINDS if k in seen)


def kind_counts(m: ModelSpec) -> dict[LayerKind, int]:
    return dict(Counter(layer_kinds(m)))


def primary_kind(m: ModelSpec) -> LayerKind:
    """The kind most of the model's layers have (MoE on a tie): the kind of a uniform model's one graph."""
    counts = kind_counts(m)
    return max(KINDS[::-1], key=lambda k: counts.get(k, 0))


def is_uniform(m: ModelSpec) -> bool:
    """Every layer of one kind: one layer graph prices the whole model (every method plans it)."""
    return len(kinds_present(m)) == 1


def stage_kinds(m: ModelSpec, first: int, count: int) -> tuple[LayerKind, ...]:
    """The kinds of layers first .. first + count - 1."""
    return layer_kinds(m)[first:first + count]


def as_kinds(names: tuple[str, ...]) -> tuple[LayerKind, ...] | None:
    """Kind names (a `StageContext.kinds`) as kinds; None for none (the model's one kind)."""
    return tuple(KINDS_BY_NAME[n] for n in names) or None


KINDS_BY_NAME: dict[str, LayerKind] = {k: k for k in KINDS}
