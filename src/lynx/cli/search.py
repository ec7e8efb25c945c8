"""`lynx plan --gpus N`: the configuration search behind `lynx plan`, and the cluster-size rules that keep
idle GPUs from going unnoticed (DP derived from --gpus / --nodes; a layout leaving GPUs idle is an error
unless --allow-idle-gpus)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from lynx.cli.common import console, err_console, print_json
from lynx.errors import SpecError
from lynx.models import load_model
from lynx.problem import PlanOptions
from lynx.spec import CpCommType, Hardware, load_hardware

if TYPE_CHECKING:
    from lynx.search import SearchResult
    from lynx.search.run import Progress


@dataclass(frozen=True, slots=True)
class SearchArgs:
    """What plan_cmd hands over (None: searched)."""

    model: str
    hardware: str
    gpus: int
    global_batch: int
    seq_len: int
    tp: int | None
    pp: int | None
    vpp: int | None
    sp: bool | None
    mb: int | None
    dist_opt: bool | None
    method: str | None
    allow_cross_node_tp: bool
    top: int
    as_json: bool
    out: Path | None
    png: Path | None
    cp: int | None = None
    cp_comm_type: CpCommType = "p2p"
    offload: bool | None = None
    """--offload/--no-offload (None: on when the hardware has a host link)."""
    ep: int | None = None
    """--ep pinned (None: searched for MoE models, `search.experts`)."""
    etp: int | None = None


def cluster_gpus(hw: Hardware, gpus: int | None, nodes: int | None) -> int | None:
    """GPUs of the cluster the user named (--gpus, else --nodes x the hardware's GPUs per node)."""
    if gpus is not None and nodes is not None and gpus > nodes * hw.devices_per_node:
        raise SpecError(f"--gpus {gpus} exceeds --nodes {nodes} x {hw.devices_per_node} GPUs per node")
    if gpus is not None:
        return gpus
    return None if nodes is None else nodes * hw.devices_per_node


def derive_dp(tp: int, pp: int, dp: int | None, total: int, where: str, allow_idle: bool, cp: int = 1) -> int:
    """DP for a layout on `total` GPUs; an error naming the product when GPUs would sit idle."""
    cp_text, per = (f" x --cp {cp}" if cp > 1 else ""), tp * cp * pp
    if dp is None:
        if total < per or (total % per and not allow_idle):
            raise SpecError(f"--tp {tp}{cp_text} x --pp {pp} = {per} GPUs per replica does not divide the {total} "
                            f"GPUs of {where}; choose TP{' x CP' if cp > 1 else ''} x PP dividing {total} "
                            "(or --allow-idle-gpus)")
        return total // per
    used = per * dp
    if used > total:
        raise SpecError(f"--tp {tp}{cp_text} x --pp {pp} x --dp {dp} = {used} GPUs; {where} has {total}")
    if used < total and not allow_idle:
        raise SpecError(f"--tp {tp}{cp_text} x --pp {pp} x --dp {dp} = {used} GPUs leaves {total - used} of the "
                        f"{total} GPUs of {where} idle; drop --dp to derive it, or pass --allow-idle-gpus")
    return dp


def run_search(a: SearchArgs, base: PlanOptions) -> None:
    from lynx.search import Pins, Space, search
    from lynx.search.report import explain, result_dict, scatter_png, search_table
    from lynx.search.space import candidates

    if a.method is not None:
        from lynx.methods import get_method

        get_method(a.method)  # one clear line for an unknown name
    hw = load_hardware(a.hardware)
    has_link = hw.host() is not None
    if a.offload and not has_link:
        raise SpecError(f"--offload: hardware {hw.name!r} has no host link; give host_link (d2h_Bps, h2d_Bps, ...) "
                        "in the hardware file, or drop --offload")
    if a.offload is not None and a.method is not None:
        raise SpecError("--offload/--no-offload adds the offloading methods to the search's; with --method the "
                        "search plans that method only (use --method lynx-offload)")
    space = Space(load_model(a.model), hw, a.gpus, a.global_batch, a.seq_len,
                  Pins(tp=a.tp, pp=a.pp, vpp=a.vpp, sp=a.sp, mb=a.mb, dist_opt=a.dist_opt, cp=a.cp,
                       ep=a.ep, etp=a.etp, methods=None if a.method is None else (a.method,)),
                  a.allow_cross_node_tp, a.cp_comm_type, has_link if a.offload is None else a.offload)
    cands, rejected = candidates(space)
    if not cands:  # nothing to search: say which rule the pins break, before any work
        pinned = [f"{flag} {size} does not divide the {a.gpus} GPUs"
                  for flag, size in (("--tp", a.tp), ("--cp", a.cp), ("--pp", a.pp))
                  if size is not None and a.gpus % size]  # the pin to change, named first
        why = "; ".join(pinned or dict.fromkeys(r.reason for r in rejected[:4])) or (
            "TP x PP must divide the GPUs and PP must not exceed the layers")
        raise SpecError(f"--gpus {a.gpus}: no layout satisfies the pinned options ({why})")
    res = _with_progress(lambda cb: search(space, base, top=a.top, progress=cb))
    if a.as_json:
        print_json(result_dict(res))
    else:
        console.print(search_table(res, a.top))
        for line in explain(res):
            console.print(line, soft_wrap=True)
    if a.png is not None and res.considered:
        from lynx.paths import atomic_path

        with atomic_path(a.png, "--search-png") as tmp:
            scatter_png(res, tmp)
        err_console.print(f"wrote {a.png}")
    best = res.best
    if best is None:
        err_console.print("lynx: no configuration fits the memory budget; no plan written", soft_wrap=True)
        raise typer.Exit(3)
    if a.out is not None and best.plan is not None:
        from lynx.plan import Plan

        Plan.evaluate(best.plan.problem, best.plan.result).save(a.out)
        err_console.print(f"wrote {a.out}")


def _with_progress(run: Callable[[Progress], SearchResult]) -> SearchResult:
    """A rich progress bar on stderr while the search runs (transient: gone once it is done)."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    with Bar(TextColumn("searching"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=err_console, transient=True) as bar:
        task = bar.add_task("", total=None)

        def cb(done: int, total: int, what: str) -> None:
            if done % 16 == 0 or done == total:  # rich's update is not free; thousands of calls add up
                bar.update(task, completed=done, total=total, description=what)

        return run(cb)
