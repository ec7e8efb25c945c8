"""Methods that cannot beat a cheaper one that fits the same layout and split: recomputation and host copies only
ever add time (the simulator charges a recomputed op's forward again, on the critical path or in a window it
would otherwise leave idle, and a copy's wait), so where a method whose recomputed set is a subset fits, a method
recomputing more is no faster. The search plans the cheaper first (`order`) and records the rest as dominated;
and where full recomputation does not fit, no module list does (`cannot_fit`)."""

from __future__ import annotations

from lynx.search.evaluate import Outcome

_SETS: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "selective": frozenset({"core_attn"}),
    "mc-mlp": frozenset({"mlp"}),
    "mc-layernorm": frozenset({"layernorm"}),
    "mc-core_attn+mlp": frozenset({"core_attn", "mlp"}),
    "mc-core_attn+layernorm": frozenset({"core_attn", "layernorm"}),
    "mc-mlp+layernorm": frozenset({"mlp", "layernorm"}),
    "mc-core_attn+mlp+layernorm": frozenset({"core_attn", "mlp", "layernorm"}),
    "full": frozenset({"core_attn", "mlp", "layernorm", "layer"}),
}
"""Megatron-Core's stock flags by the modules they recompute (`full` re-runs the whole layer, a superset of
every module list; `block`, `mc-offload`, torchtitan's `titan-sac` and lynx's methods are compared with `none` /
`lynx` only)."""

_ORDER = ("none", "lynx", "full", "selective", "titan-sac", "mc-mlp", "mc-layernorm", "mc-core_attn+mlp",
          "mc-core_attn+layernorm", "mc-mlp+layernorm", "mc-core_attn+mlp+layernorm", "block", "mc-offload",
          "lynx-offload")
"""`none` first (where it fits every other stock method is dominated), then `full` (where it does not fit, no stock
recomputation does: `cannot_fit`), then the rest cheapest first."""


def order(method: str) -> int:
    """Cheaper methods first (unknown ones last, in their given order)."""
    return _ORDER.index(method) if method in _ORDER else len(_ORDER)


def dominated(method: str, fits: dict[str, Outcome]) -> str:
    """The cheaper method that already fits and that `method` cannot beat ('' if none)."""
    mine = _SETS.get(method)
    if mine is not None:
        for name, got in _SETS.items():
            if name != method and got < mine and name in fits:
                return name
    if method in ("block", "mc-offload", "titan-sac") and "none" in fits:
        return "none"
    lynx = fits.get("lynx")
    if (method == "lynx-offload" and lynx is not None and lynx.plan is not None and lynx.candidate.layout.vpp > 1
            and not _recomputes(lynx)):  # interleaved: both screen the same dp split (1F1B searches partitions)
        return "lynx (none of its recomputation is on the critical path)"
    return ""


def cannot_fit(method: str, failed: set[str]) -> str:
    """Why `method` cannot fit where `full` did not ('' if it might): full recomputation keeps only each layer's
    input, the least any stock recompute flag keeps (a module list keeps more, `block` keeps N layers' inputs and
    the rest whole, torchtitan's per-op policy keeps the input and some outputs); Megatron's offloading is not
    compared."""
    if "full" in failed and (method in ("block", "titan-sac") or (method in _SETS and method != "full")):
        return f"full recomputation does not fit this layout and split, and {method} keeps more"
    return ""


def _recomputes(o: Outcome) -> bool:
    """Recomputation on the critical path: what offloading could replace by a copy hidden behind compute (what is
    hidden in windows and stalls costs no time already)."""
    assert o.plan is not None
    return any(st.recompute_critical_s > 0 for st in o.plan.sim.stages)
