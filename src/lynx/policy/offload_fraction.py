"""Offload a stated fraction of a stage's activations: a rule, not a solver.

Mist (EuroSys'25; github.com/Dazz993/Mist at d69e530a, `mist/analyzer/batched_module_analyzer.py`, the
`ac_ratio` term) offloads a ratio of every layer's saved activations to host memory, swapped out during the
layer's forward and back in for its backward. lynx's offload model (`lynx.policy.offload`, docs/offload.md)
moves whole op outputs (`LayerPolicy.offload`), so this rule states Mist's ratio in lynx's terms: it marks kept
op outputs of the stage as offloaded until their bytes reach the ratio of the stage's retained activation bytes
(layer inputs included, as Mist's saved tensors include them), spread over the layers as evenly as the op sizes
allow. What the simulator then prices is lynx's own: the held and host bytes (`memory.held_bytes`,
`memory.host_bytes`) and the exposed copy time (`policy.offload.stage_exposed_copy`).

lynx never offloads a layer input (docs/offload.md), so a fully recomputed layer (which keeps only its input)
offers nothing; its share is taken from the stage's other layers. Where they hold too little, the rule offloads
what there is and reports the fraction it reached.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lynx.decisions import FWD_PHASES, LayerPolicy, RecomputePolicy
from lynx.errors import SpecError
from lynx.graph import LayerGraph


@dataclass(frozen=True, slots=True)
class FractionOffload:
    """A stage policy with a fraction of its activations offloaded, and how close the op sizes let it get."""

    policy: RecomputePolicy
    stated: float
    reached: float
    """Offloaded bytes over the stage's retained activation bytes per micro-batch."""
    retained_bytes: float
    offloaded_bytes: float


def retained_stage_bytes(graph: LayerGraph, layers: tuple[LayerPolicy, ...]) -> float:
    """One micro-batch's bytes the stage holds from forward to backward (each layer's input and kept ops)."""
    return sum(graph.retained_bytes(lp.keep) - (0.0 if lp.input_checkpoint else graph.input_bytes)
               for lp in layers)


def offloadable(graph: LayerGraph, lp: LayerPolicy) -> tuple[str, ...]:
    """Kept ops the offload rules allow (`decisions.validate_layer_policy`): not re-run, not read by a phase-1/2
    recomputation, holding bytes; largest first (ties in graph order)."""
    early = {n for n, p in lp.recompute if p in FWD_PHASES}
    read = {d for n in early for d in graph.op(n).inputs}
    ok = [n for n in graph.names if n in lp.keep and n not in lp.rerun and n not in read
          and graph.keep_bytes(n) > 0]
    return tuple(sorted(ok, key=lambda n: -graph.keep_bytes(n)))


def _pick(graph: LayerGraph, ops: tuple[str, ...], goal: float) -> frozenset[str]:
    """Largest first, each op taken when it brings the layer's offloaded bytes nearer `goal`."""
    got, out = 0.0, []
    for n in ops:
        b = graph.keep_bytes(n)
        if abs(got + b - goal) < abs(got - goal):
            got += b
            out.append(n)
    return frozenset(out)


def offload_fraction(graph: LayerGraph, policy: RecomputePolicy, fraction: float) -> FractionOffload:
    """`policy` with `fraction` (in [0, 1]) of its stage's retained activation bytes offloaded (module docstring).
    The layers' keep and recompute sets are unchanged; each layer's goal is what is still to offload shared
    evenly over the layers left that can offload, so a layer that falls short passes its rest upwards."""
    if not 0.0 <= fraction <= 1.0:
        raise SpecError(f"activation offload fraction {fraction} must lie in [0, 1]")
    layers = policy.layers
    total = retained_stage_bytes(graph, layers)
    cands = [offloadable(graph, lp) for lp in layers]
    left = fraction * total
    out: list[LayerPolicy] = []
    for i, lp in enumerate(layers):
        able = sum(1 for c in cands[i:] if c)
        chosen = _pick(graph, cands[i], left / able) if cands[i] and left > 0 else frozenset()
        left -= sum(graph.keep_bytes(n) for n in chosen)
        out.append(replace(lp, offload=lp.offload | chosen))
    moved = sum(graph.keep_bytes(n) for lp in out for n in lp.offload)
    reached = moved / total if total > 0 else 0.0
    return FractionOffload(replace(policy, layers=tuple(out)), fraction, reached, total, moved)
