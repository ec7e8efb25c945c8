"""The partition in the frameworks' terms: Megatron-Core's pipeline layout string and its first/last-stage
counts, read and written.

A `ChunkLayout` lists the transformer layers of every *virtual* stage in Megatron's order: with `pp` ranks
and `vpp` chunks per rank, chunk c of rank r is virtual stage ``v = c * pp + r`` and holds the layers after
those of virtual stages ``0 .. v-1``. Without interleaving (vpp = 1) a virtual stage is a pipeline stage.

Megatron's layout grammar (megatron/core/transformer/pipeline_parallel_layer_layout.py, 0.16): virtual
stages are separated by ``|``; ``E`` is the embedding, ``t`` one decoder layer, ``L`` the output layer and
loss, ``m`` an MTP layer; ``x*n`` repeats one character, ``(...)*n`` a group; commas are cosmetic. Stages are
listed in virtual-stage order, so ``"Et*3|t*4|t*4|t*4|t*4|t*4|t*4|t*5L"`` with PP 4 is VPP 2.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lynx.errors import SpecError


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """Transformer layers per virtual stage, in Megatron's virtual-stage order (v = chunk * pp + rank)."""

    pp: int
    vpp: int
    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.pp < 1 or self.vpp < 1:
            raise SpecError(f"layout: pp {self.pp} and vpp {self.vpp} must be positive")
        if len(self.layers) != self.pp * self.vpp:
            raise SpecError(f"layout: {len(self.layers)} virtual stages, expected pp x vpp = {self.pp * self.vpp}")
        if min(self.layers) < 0:
            raise SpecError("layout: a virtual stage cannot hold a negative number of layers")

    @property
    def num_layers(self) -> int:
        return sum(self.layers)

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return chunk * self.pp + rank

    def first_layer(self, v: int) -> int:
        """Global index of the first transformer layer of virtual stage v."""
        return sum(self.layers[:v])

    def layer_ids(self, v: int) -> range:
        start = self.first_layer(v)
        return range(start, start + self.layers[v])

    def rank_layers(self, rank: int) -> tuple[int, ...]:
        """Layers of each chunk a rank holds, chunk 0 first."""
        return tuple(self.layers[self.virtual_stage(rank, c)] for c in range(self.vpp))


# -- Megatron's layout string ------------------------------------------------------------------------------


def megatron_layout(layout: ChunkLayout) -> str:
    """``--pipeline-model-parallel-layout``: E on the first virtual stage, L on the last, ``t*n`` per stage."""
    parts: list[str] = []
    last = len(layout.layers) - 1
    for v, n in enumerate(layout.layers):
        body = "t" * n if n <= 1 else f"t*{n}"
        parts.append(("E" if v == 0 else "") + body + ("L" if v == last else ""))
    return "|".join(parts)


_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")
_REPEAT = re.compile(r"(.)\*(\d+)")
_LAYER_CHARS = frozenset("ELtm")


def parse_megatron_layout(text: str, pp: int, num_layers: int) -> ChunkLayout:
    """Read a layout string (our own reader of Megatron's grammar; see the module docstring) and check
    what Megatron checks: a multiple of PP stages, E first and once, L last and once, `num_layers` decoders."""
    where = f"--pipeline-model-parallel-layout {text!r}"
    s = text.replace(",", "").replace(" ", "")
    s = _GROUP.sub(lambda m: m.group(1) * int(m.group(2)), s)
    s = _REPEAT.sub(lambda m: m.group(1) * int(m.group(2)), s)
    stages = s.split("|")
    bad = sorted({c for c in s if c not in _LAYER_CHARS and c != "|"})
    if bad:
        raise SpecError(f"{where}: unknown layer character(s) {''.join(bad)}; known: E, t, L, m")
    if "m" in s:
        raise SpecError(f"{where}: multi-token-prediction layers (m) are not modelled by lynx")
    if len(stages) % pp:
        raise SpecError(f"{where}: {len(stages)} stages is not a multiple of --pipeline-model-parallel-size {pp}")
    flat = "".join(stages)
    if not flat.startswith("E") or flat.count("E") != 1:
        raise SpecError(f"{where}: the embedding E must come first, exactly once")
    if not flat.endswith("L") or flat.count("L") != 1:
        raise SpecError(f"{where}: the loss L must come last, exactly once")
    counts = tuple(st.count("t") for st in stages)
    if sum(counts) != num_layers:
        raise SpecError(f"{where}: {sum(counts)} decoder layers, --num-layers says {num_layers}")
    return ChunkLayout(pp, len(stages) // pp, counts)


def first_last_counts(layout: ChunkLayout) -> tuple[int, int] | None:
    """(first, last) for ``--decoder-first/last-pipeline-num-layers`` when they reproduce the layout: no
    interleaving and the middle stages even (Megatron splits the rest evenly); None otherwise."""
    if layout.vpp != 1 or layout.pp < 3:
        return None
    mid = layout.layers[1:-1]
    if len(set(mid)) != 1 or mid[0] < 1:
        return None
    return layout.layers[0], layout.layers[-1]


def even_layout(pp: int, vpp: int, num_layers: int, flag: str) -> ChunkLayout:
    """Megatron's default split: every virtual stage gets num_layers / (pp * vpp) layers."""
    n = pp * vpp
    if num_layers % n:
        raise SpecError(f"{flag}: {num_layers} layers do not split evenly over {n} (virtual) stages; "
                        "give --pipeline-model-parallel-layout")
    return ChunkLayout(pp, vpp, (num_layers // n,) * n)


def first_last_layout(pp: int, num_layers: int, first: int | None, last: int | None) -> ChunkLayout:
    """``--decoder-first/last-pipeline-num-layers``: the given ends, the rest evenly over the middle stages."""
    f = 0 if first is None else first
    la = 0 if last is None else last
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - f - la
    if rest < 0 or (middle == 0 and rest != 0) or (middle > 0 and rest % middle):
        raise SpecError(f"--decoder-first/last-pipeline-num-layers {first}/{last}: the other {rest} of "
                        f"{num_layers} layers do not split evenly over {middle} middle stage(s)")
    each = rest // middle if middle else 0
    counts = ([f] if first is not None else []) + [each] * middle + ([la] if last is not None else [])
    return ChunkLayout(pp, 1, tuple(counts))
