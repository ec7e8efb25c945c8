"""Which mode a `lynx plan` command line is in, and the options each mode reads (issue 36: an option that only
matters to one mode is an error in another, naming the mode that needs it).

`given(ctx)` is what the user typed (not the defaults), read from the CLI library's parameter sources, so
`--top 5` is as much an error without `--gpus` as `--top 3`."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Any

import typer

from lynx.errors import SpecError


class Mode(enum.Enum):
    SEARCH = "search"
    """The configuration search (--gpus N, or --nodes K without --tp and --pp)."""
    SINGLE = "single"
    """One layout (--tp/--pp/--dp, without --gpus)."""
    MEGATRON = "megatron"
    """A Megatron command line (--from-megatron)."""


def given(ctx: typer.Context) -> frozenset[str]:
    """The parameters set on the command line (or the environment), by their Python name."""
    out = set()
    for name in ctx.params:
        src = ctx.get_parameter_source(name)
        if src is not None and src.name in ("COMMANDLINE", "ENVIRONMENT"):
            out.add(name)
    return frozenset(out)


def flag(name: str) -> str:
    """The option as the user types it (`layers_per_stage` -> `--layers-per-stage`)."""
    return FLAG_NAMES.get(name, "--" + name.replace("_", "-"))


FLAG_NAMES = {"as_json": "--json", "offload": "--offload/--no-offload", "sp": "--sp/--no-sp",
              "distributed_optimizer": "--distributed-optimizer", "hierarchical_cp": "--hierarchical-context-"
              "parallel-sizes", "search_png": "--search-png", "no_cooldown_overlap": "--no-cooldown-overlap",
              "global_batch": "--global-batch", "micro_batch": "--micro-batch", "seq_len": "--seq-len",
              "plan_file": "--plan", "busbw": "--busbw", "gantt": "--gantt", "png": "--png"}

SEARCH_ONLY = ("top", "search_png", "allow_cross_node_tp", "offload", "target", "no_production_overlaps", "jobs",
               "search_time_limit")
"""Read by the configuration search only."""
SINGLE_ONLY = ("compare", "gantt", "memory_png", "profile", "db", "layers_per_stage", "hierarchical_cp", "busbw",
               "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
               "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
"""Read when one layout is planned (not by the search, which plans each candidate its own way)."""
MEGATRON_READS = ("from_megatron", "hardware", "dp", "nodes", "budget_gb", "bytes_per_param", "as_json", "out",
                  "precision", "distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
                  "tp_comm_overlap", "allow_idle_gpus")
"""lynx's own options that `--from-megatron` reads beside the command line (the rest come from it)."""
MEGATRON_PINS = ("model", "tp", "pp", "cp", "vpp", "sp", "micro_batch", "global_batch", "seq_len", "cp_comm_type",
                 "ep", "etp")
"""Layout options a Megatron command line also sets: given with --from-megatron, they must agree with it."""


def plan_mode(params: Mapping[str, Any], typed: frozenset[str]) -> Mode:
    if params["from_megatron"] is not None:
        return Mode.MEGATRON
    if params["gpus"] is not None or (params["nodes"] is not None and (params["tp"] is None or params["pp"] is None)):
        return Mode.SEARCH
    return Mode.SINGLE


def refuse(typed: Iterable[str], names: Iterable[str], text: str) -> None:
    """One line for the first of `names` the user typed (in `names`' order); `text` formats it by `{flag}`."""
    names = tuple(names)
    for n in names:
        if n in typed:
            raise SpecError(text.format(flag=flag(n)))


def check_plan_mode(params: Mapping[str, Any], typed: frozenset[str]) -> Mode:
    """The mode, after refusing every typed option that mode does not read."""
    mode = plan_mode(params, typed)
    if mode is Mode.SEARCH:
        refuse(typed, SINGLE_ONLY, "{flag} plans one layout only; with --gpus / --nodes lynx searches layouts (drop "
               "{flag}, or give --tp, --pp and --dp without --gpus)")
    elif mode is Mode.SINGLE:
        refuse(typed, SEARCH_ONLY, "{flag} is read by the configuration search only; add --gpus N (or --nodes K "
               "without --tp/--pp) to search layouts, or drop {flag}")
        if "allow_idle_gpus" in typed and params["nodes"] is None:
            raise SpecError("--allow-idle-gpus accepts a layout that leaves some of --gpus / --nodes idle; give "
                            "--gpus N or --nodes K")
    else:
        if params["gpus"] is not None:
            raise SpecError("--gpus searches layouts; --from-megatron prices the one its command line gives "
                            "(drop one of them)")
        for n in sorted(typed):
            if n not in MEGATRON_READS and n not in MEGATRON_PINS:
                raise SpecError(f"{flag(n)} is not read with --from-megatron: give it inside the Megatron "
                                "command line, or plan without --from-megatron")
    return mode
