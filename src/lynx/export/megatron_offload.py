"""A plan's offloading as Megatron-Core's fine-grained activation offloading (docs/offload.md).

Megatron-Core's fields (megatron/core/transformer/transformer_config.py): ``fine_grained_activation_offloading``
and ``offload_modules`` (in 0.16.1), ``activation_offload_fraction`` and ``delta_offload_bytes_across_pp_ranks``
(added after 0.16.1, on Megatron-LM's main branch). Flags: ``--fine-grained-activation-offloading
--offload-modules ... --activation-offload-fraction F``. The plugin sets each stage's modules and fraction on its
own TransformerConfig; the PP delta is not needed (the plan gives every stage its own setting).

What Megatron cannot express is listed beside the plan: op outputs that no module's input covers (the dense
MLP's activations: Megatron offloads only MoE ``expert_fc1``/``moe_act`` there), and the offload margin (Megatron
never offloads the last layer's groups of a chunk, lynx may)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lynx.decisions import LayerPolicy, RecomputePolicy
from lynx.graph import LayerGraph
from lynx.policy.megatron_offload import module_offload_ops, ops_to_modules


def offload_entry(graph: LayerGraph, pol: RecomputePolicy) -> dict[str, Any]:
    """The plugin's offload fields for one (virtual) stage; empty when it offloads nothing."""
    ops = frozenset(n for lp in pol.layers for n in lp.offload)
    if not ops:
        return {}
    mods, _ = ops_to_modules(graph, ops)
    if not mods:
        return {}
    covered = {n for m in mods for n in module_offload_ops(graph, m)}
    # Megatron's margin always keeps the top layer's groups; the fraction applies to the layers below it, whose
    # groups it turns off from the top (forward order's end): the share of them the plan offloads
    below = pol.layers[:-1] or pol.layers
    layers_on = sum(1 for lp in below if covered & lp.offload)
    return {"fine_grained_activation_offloading": True, "offload_modules": list(mods),
            "activation_offload_fraction": round(layers_on / len(below), 6)}


def offload_notes(graph: LayerGraph, pol: RecomputePolicy, where: str) -> list[str]:
    """What Megatron's modules cannot express of this stage's offloading."""
    ops = frozenset(n for lp in pol.layers for n in lp.offload)
    if not ops:
        return []
    _, rest = ops_to_modules(graph, ops)
    notes = []
    if rest:
        notes.append(f"{where}: offloads {', '.join(sorted(rest))}, which no Megatron --offload-modules entry covers "
                     "(Megatron keeps them on the device)")
    if pol.layers and pol.layers[-1].offload:
        notes.append(f"{where}: offloads in its top layer; Megatron's offload margin keeps the last layer's groups "
                     "on the device")
    return notes


def offload_flags(entries: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The global flags: offloading on with the union of the stages' modules (the plugin narrows each stage)."""
    mods: list[str] = []
    for e in entries:
        mods += [m for m in e.get("offload_modules", []) if m not in mods]
    if not mods:
        return []
    return [("--fine-grained-activation-offloading",), ("--offload-modules", *mods)]


def apply_offload(graph: LayerGraph, layers: tuple[LayerPolicy, ...], entry: Mapping[str, Any] | None
                  ) -> tuple[LayerPolicy, ...]:
    """What Megatron offloads under one stage's plugin entry, on top of its recomputation setting's layer policies
    (to price the exported plugin): the modules' input tensors where the setting keeps them, in every layer but
    the top one (the margin), less the last ``1 - fraction`` of those layers (Megatron turns groups off from the
    end of the forward order)."""
    if not entry or not entry.get("fine_grained_activation_offloading"):
        return layers
    ops = frozenset(n for m in entry.get("offload_modules", []) for n in module_offload_ops(graph, m))
    below = len(layers) - 1
    sets = [(ops & lp.keep) - lp.rerun for lp in layers[:max(0, below)]]
    # the PP delta: `rank * delta` bytes stay on the device, whole layers' groups from the front
    keep_dev, first = float(entry.get("keep_on_device_bytes", 0.0)), 0
    while first < len(sets) and keep_dev > 0:
        keep_dev -= sum(graph.keep_bytes(n) for n in sets[first])
        first += 1
    rest = len(sets) - first
    k = first + rest - int(rest * (1.0 - float(entry.get("activation_offload_fraction", 1.0))))
    out = list(layers)
    for i in range(first, k):
        lp = layers[i]
        out[i] = LayerPolicy(lp.keep, lp.recompute, lp.input_checkpoint, lp.rerun, sets[i])
    return tuple(out)


def command_offload(entry: Mapping[str, Any] | None, num_virtual_stages: int, pp: int) -> list[dict[str, Any]] | None:
    """An imported command's offloading per virtual stage (`apply_offload` entries): the same modules and
    fraction everywhere, rank r keeping ``r * delta`` bytes on the device."""
    if not entry:
        return None
    delta = float(entry.get("delta_offload_bytes_across_pp_ranks", 0.0))
    return [{**entry, "keep_on_device_bytes": (v % pp) * delta} for v in range(num_virtual_stages)]
