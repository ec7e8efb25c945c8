"""Megatron-Core's recomputation settings, and how a lynx stage policy maps onto them and back.

Megatron-Core (TransformerConfig, 0.16) offers one setting per config:

- ``recompute_granularity=None``: keep everything;
- ``"selective"`` with ``recompute_modules`` (``core_attn``, ``layernorm``, ``mlp`` for dense models):
  every layer drops the named submodules' activations and reruns them before their backward;
- ``"full"`` with ``recompute_method="block"`` and N: the first N layers of each model chunk keep only
  their input and rerun the whole layer; or ``"uniform"`` and N: the chunk's layers are cut into groups of N
  that keep only the group's input.

A lynx stage policy says per layer and per op what is kept, and when each dropped op is recomputed (inside
a collective or on demand). Megatron runs every recomputation on demand, so the phases are lost; a keep set
is rounded *up* to the smallest module set that drops at least what lynx drops (memory no higher than
lynx's keep set, time no lower), and a stage that mixes full and selective layers becomes full for those
layers. Every rounding is reported as a note.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Literal

from lynx.cost.pricing import ops_recompute_cost
from lynx.decisions import LayerPolicy, Phase, RecomputePolicy
from lynx.errors import SpecError
from lynx.graph import Graphs, LayerGraph, per_layer
from lynx.policy.megatron_modules import dropped_ops, modules_layer
from lynx.policy.rules import full_layer, keep_all

Granularity = Literal["full", "selective"]
RecomputeMethod = Literal["uniform", "block"]

MODULE_ORDER: tuple[str, ...] = ("core_attn", "layernorm", "mlp", "moe", "moe_act", "shared_experts", "mla_up_proj")
"""Megatron's --recompute-modules (the MoE and MLA ones: `policy.megatron_modules`); the ops each drops are its
`Op.module` tags in the graph."""


@dataclass(frozen=True, slots=True)
class MegatronRecompute:
    """One Megatron recomputation setting, checked with the rules TransformerConfig.__post_init__ applies."""

    granularity: Granularity | None = None
    method: RecomputeMethod | None = None
    num_layers: int | None = None
    modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        g, m, n = self.granularity, self.method, self.num_layers
        if g is None and (m is not None or n is not None or self.modules):
            raise SpecError("recompute: method, num-layers and modules need --recompute-granularity")
        if g == "full" and (m is None or n is None or n < 1 or self.modules):
            raise SpecError("--recompute-granularity full needs --recompute-method uniform|block and "
                            "--recompute-num-layers >= 1 (and no --recompute-modules)")
        if g == "selective":
            if m is not None or n is not None:
                raise SpecError("--recompute-granularity selective takes no --recompute-method/--recompute-num-layers")
            unknown = [x for x in self.modules if x not in MODULE_ORDER]
            if unknown or not self.modules:
                raise SpecError(f"--recompute-modules {' '.join(self.modules) or '(none)'}: lynx models "
                                f"{', '.join(MODULE_ORDER)}")

    def flags(self) -> list[str]:
        if self.granularity is None:
            return []
        out = ["--recompute-granularity", self.granularity]
        if self.granularity == "full":
            out += ["--recompute-method", str(self.method), "--recompute-num-layers", str(self.num_layers)]
        else:
            out += ["--recompute-modules", *self.modules]
        return out

    def describe(self) -> str:
        return " ".join(self.flags()) or "no recomputation"

    def short(self) -> str:
        if self.granularity is None:
            return "none"
        if self.granularity == "selective":
            return "selective " + "+".join(self.modules)
        return f"full {self.method} {self.num_layers}"

    def to_dict(self) -> dict[str, object]:
        return {"recompute_granularity": self.granularity, "recompute_method": self.method,
                "recompute_num_layers": self.num_layers,
                "recompute_modules": list(self.modules) if self.granularity == "selective" else None}


NONE = MegatronRecompute()


def covered_ops(graph: LayerGraph, modules: Sequence[str]) -> frozenset[str]:
    """The graph's backward-needed ops that these Megatron modules drop (lynx's own module-list baseline
    rule, `lynx.policy.megatron_modules.dropped_ops`)."""
    return frozenset(dropped_ops(graph, tuple(modules))) & graph.needed()


def _min_modules(graph: LayerGraph, dropped: frozenset[str]) -> tuple[str, ...] | None:
    """The fewest modules (then the fewest extra ops dropped) that drop at least `dropped`."""
    useful = [m for m in MODULE_ORDER if covered_ops(graph, (m,))]
    best: tuple[str, ...] | None = None
    for k in range(1, len(useful) + 1):
        for combo in combinations(useful, k):
            cov = covered_ops(graph, combo)
            if dropped <= cov and (best is None or len(cov) < len(covered_ops(graph, best))):
                best = combo
        if best is not None:
            return best
    return None


LayerClass = Literal["none", "selective", "full"]


def classify_layer(graph: LayerGraph, lp: LayerPolicy) -> tuple[LayerClass, tuple[str, ...]]:
    """What Megatron setting reproduces one lynx layer policy at least as memory-frugally."""
    needed = graph.needed()
    dropped = needed - lp.keep
    if not lp.input_checkpoint or dropped == needed:
        return "full", ()
    if not dropped:
        return "none", ()
    mods = _min_modules(graph, dropped)
    return ("full", ()) if mods is None else ("selective", mods)


def chunk_setting(graph: Graphs, policy: RecomputePolicy, where: str) -> tuple[MegatronRecompute, list[str]]:
    """The Megatron setting for one (virtual) stage of a lynx plan, and notes on what it could not keep (`graph`:
    one per layer for a stack of layer kinds)."""
    notes: list[str] = []
    gs = per_layer(graph, len(policy.layers))
    classes = [classify_layer(g, lp) for g, lp in zip(gs, policy.layers, strict=True)]
    n = len(classes)
    kinds = {c for c, _ in classes}
    if kinds == {"none"} or n == 0:
        return NONE, notes
    if any(not lp.input_checkpoint for lp in policy.layers):
        run = max(_chunk_runs(policy.layers))
        return MegatronRecompute("full", "uniform", run), notes
    if "selective" in kinds and "full" not in kinds:
        mods = tuple(m for m in MODULE_ORDER if any(m in ms for c, ms in classes if c == "selective"))
        exact = all(c == "selective" and ms == mods for c, ms in classes)
        if not exact:
            notes.append(f"{where}: per-layer keep sets differ; every layer recomputes {','.join(mods)}")
        for g, lp, (c, _ms) in zip(gs, policy.layers, classes, strict=True):
            extra = covered_ops(g, mods) - (g.needed() - lp.keep)
            if c == "selective" and extra:
                notes.append(f"{where}: keep set rounded to --recompute-modules {' '.join(mods)} "
                             f"(also drops {', '.join(sorted(extra))})")
                break
        return MegatronRecompute("selective", None, None, mods), notes
    k = sum(1 for c, _ in classes if c != "none")
    if "selective" in kinds:
        notes.append(f"{where}: selective layers made full (Megatron has one granularity per config)")
    if any(c != "none" for c, _ in classes[k:]):
        notes.append(f"{where}: Megatron's block recomputes the first {k} layers; lynx chose other positions")
    return MegatronRecompute("full", "block", k), notes


def hidden_note(policy: RecomputePolicy, where: str) -> list[str]:
    """What Megatron loses outright: lynx's recomputation inside collectives and stalls runs on demand."""
    hidden = sum(1 for lp in policy.layers for _, p in lp.recompute if p != Phase.ON_DEMAND)
    return [f"{where}: {hidden} op recomputations lynx hides in collectives or stalls run on demand"] if hidden else []


def _chunk_runs(layers: Sequence[LayerPolicy]) -> list[int]:
    """Lengths of Megatron uniform groups: a layer with its input checkpoint starts a group."""
    runs: list[int] = []
    for lp in layers:
        if lp.input_checkpoint or not runs:
            runs.append(1)
        else:
            runs[-1] += 1
    return runs


def collapse(settings: Sequence[MegatronRecompute], layers: Sequence[int]) -> tuple[MegatronRecompute, list[str]]:
    """One global setting for stock Megatron: the most frugal of the per-stage settings, for every stage."""
    active = [(s, n) for s, n in zip(settings, layers, strict=True) if s.granularity is not None]
    if not active:
        return NONE, []
    if all(s.granularity == "selective" for s, _ in active):
        mods = tuple(m for m in MODULE_ORDER if any(m in s.modules for s, _ in active))
        return MegatronRecompute("selective", None, None, mods), []
    notes: list[str] = []
    uniform = [s.num_layers or 1 for s, _ in active if s.method == "uniform"]
    if uniform:
        return MegatronRecompute("full", "uniform", max(uniform)), notes
    k = max((s.num_layers or 0) if s.granularity == "full" else n for s, n in active)
    if any(s.granularity == "selective" for s, _ in active):
        notes.append("stock: stages with selective recomputation become full block (one granularity)")
    return MegatronRecompute("full", "block", k), notes


def stack_policies(graph: Graphs, rec: MegatronRecompute, num_layers: int) -> tuple[LayerPolicy, ...]:
    """`layer_policies` with one graph per layer: layer i takes position i's policy on its own kind's graph."""
    if isinstance(graph, LayerGraph):
        return layer_policies(graph, rec, num_layers)
    by = {id(g): layer_policies(g, rec, num_layers) for g in graph}
    return tuple(by[id(g)][i] for i, g in enumerate(graph))


def layer_policies(graph: LayerGraph, rec: MegatronRecompute, num_layers: int) -> tuple[LayerPolicy, ...]:
    """The lynx layer policies that one Megatron setting means for a chunk of `num_layers` layers."""
    if rec.granularity is None:
        return (keep_all(graph),) * num_layers
    if rec.granularity == "selective":
        return (modules_layer(graph, rec.modules),) * num_layers  # the mc-* baselines' rule, re-runs included
    k = rec.num_layers or 1
    full = full_layer(graph)
    if rec.method == "block":
        kept = keep_all(graph)
        return tuple(full if i < k else kept for i in range(num_layers))
    chunked = LayerPolicy(keep=full.keep, recompute=full.recompute, input_checkpoint=False)
    return tuple(full if i % k == 0 else chunked for i in range(num_layers))


def candidates(graph: LayerGraph, num_layers: int) -> list[MegatronRecompute]:
    """Every setting Megatron can express for a chunk of `num_layers` layers, cheapest recomputation first
    (cost: forward time of the ops rerun on demand, the simulator decides what fits)."""
    useful = [m for m in MODULE_ORDER if covered_ops(graph, (m,))]
    out = [NONE]
    out += [MegatronRecompute("selective", modules=c) for k in range(1, len(useful) + 1)
            for c in combinations(useful, k)]
    out += [MegatronRecompute("full", "block", k) for k in range(1, num_layers + 1)]
    out += [MegatronRecompute("full", "uniform", k) for k in range(2, num_layers + 1)]
    return sorted(out, key=lambda r: recompute_cost(graph, r, num_layers))


def recompute_cost(graph: LayerGraph, rec: MegatronRecompute, num_layers: int) -> float:
    """Seconds of forward work rerun per micro-batch (ties: the order `candidates` lists them in). Each distinct
    layer policy object is priced once (a chunk's layers share a few), the sum taken over every layer in order
    as before."""
    per: dict[int, float] = {}

    def cost(lp: LayerPolicy) -> float:
        c = per.get(id(lp))
        if c is None:
            c = per[id(lp)] = ops_recompute_cost(graph, (*lp.recomputed(), *sorted(lp.rerun)))
        return c

    return sum(cost(lp) for lp in layer_policies(graph, rec, num_layers))
