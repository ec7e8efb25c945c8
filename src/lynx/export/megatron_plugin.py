"""Per-rank activation recomputation for Megatron-Core, from a lynx plan.

`lynx export megatron` writes this file as ``lynx_megatron_plugin.py`` with the plan's table filled in.
Megatron-Core's recomputation flags are global; its model builder, however, builds every pipeline rank's
(and every virtual chunk's) layers from its own ``TransformerConfig``, and the transformer block reads
``recompute_granularity/method/num_layers/modules`` from that config. Replacing them per rank gives each
stage the setting the plan chose. In Megatron-LM's ``model_provider`` (pretrain_gpt.py), after the config
is built::

    config = core_transformer_config_from_args(args)
    from lynx_megatron_plugin import apply_lynx_plan
    config = apply_lynx_plan(config, vp_rank=vp_stage)   # pp rank read from parallel_state

Needs nothing but the standard library at import; Megatron-Core is imported only to read the pipeline rank
when it is not passed in. What Megatron cannot do (recompute inside a collective, keep sets finer than its
module list) is listed in the plan's notes and in docs/export.md.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    C = TypeVar("C", bound=DataclassInstance)
else:
    C = TypeVar("C")

RECOMPUTE_FIELDS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")
OFFLOAD_FIELDS = ("fine_grained_activation_offloading", "offload_modules", "activation_offload_fraction")
"""Megatron-Core's fine-grained activation offloading, per stage when the plan offloads (the first two exist in
megatron-core 0.16.1, the fraction in later versions)."""

LYNX_PLAN: dict[str, Any] = {}  # lynx:plan-table (filled in by `lynx export megatron`)


def recompute_for(pp_rank: int, vp_rank: int | None = None, plan: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The four recompute fields for one pipeline rank (and virtual chunk)."""
    table = LYNX_PLAN if plan is None else plan
    if not table:
        raise ValueError("lynx plugin: no plan table; write this file with `lynx export megatron`")
    pp, vpp = int(table["pp"]), int(table["vpp"])
    chunk = 0 if vp_rank is None else int(vp_rank)
    if not (0 <= pp_rank < pp and 0 <= chunk < vpp):
        raise ValueError(f"lynx plugin: rank {pp_rank} chunk {chunk} outside the plan's PP {pp} x VPP {vpp}")
    entry = table["stages"][chunk * pp + pp_rank]
    fields = RECOMPUTE_FIELDS + tuple(f for f in OFFLOAD_FIELDS if f in entry)
    return {f: (list(entry[f]) if isinstance(entry[f], list) else entry[f]) for f in fields}


def _offload_supported(config: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """Drop a fraction of 1 the installed megatron-core cannot take (its default offloads every group); any other
    offload field the config lacks is an error naming it."""
    have = {f.name for f in dataclasses.fields(config)}
    if fields.get("activation_offload_fraction") == 1.0 and "activation_offload_fraction" not in have:
        fields = {k: v for k, v in fields.items() if k != "activation_offload_fraction"}
    missing = [f for f in OFFLOAD_FIELDS if f in fields and f not in have]
    if missing:
        raise ValueError(f"lynx plugin: the plan offloads with {', '.join(missing)}, which this megatron-core's "
                         "TransformerConfig lacks (fine-grained activation offloading with a fraction needs a "
                         "version after 0.16.1)")
    return fields


def _check_config(config: Any, table: Mapping[str, Any]) -> None:
    want = {"num_layers": table["num_layers"], "pipeline_model_parallel_size": table["pp"]}
    bad = [f"{k} {getattr(config, k, None)} (plan: {v})" for k, v in want.items() if getattr(config, k, v) != v]
    vpp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    if vpp is not None and vpp != table["vpp"]:
        bad.append(f"virtual_pipeline_model_parallel_size {vpp} (plan: {table['vpp']})")
    if bad:
        raise ValueError("lynx plugin: the run does not match the plan: " + ", ".join(bad))


def apply_lynx_plan(config: C, pp_rank: int | None = None, vp_rank: int | None = None,
                    plan: Mapping[str, Any] | None = None) -> C:
    """A copy of `config` (a Megatron-Core TransformerConfig) with this rank's recomputation setting.

    `dataclasses.replace` reruns TransformerConfig's own validation on the new values.
    """
    table = LYNX_PLAN if plan is None else plan
    _check_config(config, table)
    if pp_rank is None:
        ps = importlib.import_module("megatron.core.parallel_state")
        pp_rank = int(ps.get_pipeline_model_parallel_rank())
    return dataclasses.replace(config, **_offload_supported(config, recompute_for(pp_rank, vp_rank, table)))
