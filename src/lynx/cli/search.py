"""`lynx plan --gpus N`: the configuration search behind `lynx plan`, and the cluster-size rules that keep
idle GPUs from going unnoticed (DP derived from --gpus / --nodes; a layout leaving GPUs idle is an error
unless --allow-idle-gpus)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from lynx.cli.common import FAST_EXIT, check_ints, console, err_console, print_json
from lynx.cost.fsdp import FSDP2, DpSharding
from lynx.errors import SpecError
from lynx.fp8 import Fp8Engine
from lynx.request import DEFAULT_TARGET, Request, Target, parse_target
from lynx.spec import CpCommType, Hardware, ModelSpec, load_hardware
from lynx.validate import POSITIVE

if TYPE_CHECKING:
    from lynx.cli.plan_flags import PlanFlags
    from lynx.search import SearchResult
    from lynx.search.run import Progress
    from lynx.search.space import Rejected

MAX_GLOBAL_BATCH = 1 << 24
"""Samples per iteration the search takes: 16.7M sequences (Llama 3 405B trained with 16M tokens, 2,048
sequences of 8k); beyond it a typo, refused before its divisors are enumerated per layout."""
MAX_GPUS = 1 << 20
"""The largest cluster the search takes (--gpus, --nodes x GPUs per node): 1,048,576 GPUs, 10x the largest
published training cluster; a count beyond it is a typo, refused in one line instead of enumerated."""


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
    cp_comm_type: CpCommType | None = None
    """--cp-comm-type when given (honoured for every candidate); None: the search tries each."""
    offload: bool | None = None
    """--offload/--no-offload (None: on when the hardware has a host link)."""
    target: Target = DEFAULT_TARGET
    production_overlaps: bool = True
    """Megatron's production overlaps on every candidate (off: --no-production-overlaps)."""
    fsdp: DpSharding | None = None
    """The FSDP the user named (--use-torch-fsdp2, --use-megatron-fsdp ...): FSDP layouts only, that one;
    None: FSDP2 searched beside DDP."""
    ep: int | None = None
    """--ep pinned (None: searched for MoE models, `search.experts`)."""
    etp: int | None = None
    jobs: int | None = None
    """--jobs (None: `parallel.auto_jobs`)."""
    time_limit_s: float | None = None
    """--search-time-limit (None: no limit, 0 on the command line)."""
    precision_defaulted: bool = False
    """Neither --precision nor --bytes-per-param was given: the search priced `SEARCH_PRECISION` (said below the
    table)."""


SEARCH_PRECISION = "megatron-bf16"
"""The static-memory recipe a search prices unless told (decision 0277): bf16 weights and gradients with fp32 main
gradients, main weights and Adam state, what every target runs (Megatron-Core's --bf16, `lynx train --precision
megatron-bf16`, torchtitan's FSDP mixed precision). The paper's 16-byte recipe, a single layout's default, runs on
none of them: a search ranking for one must not price less memory than it will hold."""

PRECISION_TEXT = (f"Static memory: --precision {SEARCH_PRECISION} (bf16 weights and gradients, fp32 main gradients, "
                  "main weights and Adam state: what Megatron-Core's --bf16 runs, and lynx train's bf16){titan}; "
                  "--precision or --bytes-per-param prices another recipe.")
"""The line under the table when the search chose the recipe; `{titan}` names torchtitan's own rule for its rows."""
TITAN_PRECISION = (" for the search's own ranking; the torchtitan prices hold torchtitan's FSDP2 state (fp32 "
                   "weights, gradients and AdamW state sharded, 16 bytes over the shard degree, decision 0102)")


def cluster_gpus(hw: Hardware, gpus: int | None, nodes: int | None) -> int | None:
    """GPUs of the cluster the user named (--gpus, else --nodes x the hardware's GPUs per node)."""
    if gpus is not None and nodes is not None and gpus > nodes * hw.devices_per_node:
        raise SpecError(f"--gpus {gpus} exceeds --nodes {nodes} x {hw.devices_per_node} GPUs per node")
    total = gpus if gpus is not None else (None if nodes is None else nodes * hw.devices_per_node)
    if total is not None and total > MAX_GPUS:
        what = f"--gpus {gpus}" if gpus is not None else f"--nodes {nodes} x {hw.devices_per_node} GPUs per node"
        raise SpecError(f"{what} = {total:,} GPUs; the search takes up to {MAX_GPUS:,}")
    return total


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


def search_cmd(f: PlanFlags) -> None:
    """`lynx plan --gpus N` (or --nodes K without a full layout): the request every candidate shares, the pins,
    then the search."""
    from lynx.cli.plan_flags import search_request
    from lynx.export.targets import check_target
    from lynx.models import load_model

    check_ints(**{"--tp": (f.tp, POSITIVE), "--pp": (f.pp, POSITIVE), "--dp": (f.dp, POSITIVE),
                  "--cp": (f.cp, POSITIVE), "--micro-batch": (f.micro_batch, POSITIVE),
                  "--global-batch": (f.global_batch, POSITIVE), "--seq-len": (f.seq_len, POSITIVE)})
    if f.cp_comm_type == "a2a+p2p":
        raise SpecError("--cp-comm-type a2a+p2p with --gpus / --nodes: its hierarchical sizes depend on the CP size; "
                        "search with p2p, a2a or all_gather, or give the layout with --tp --pp --cp")
    if f.global_batch > MAX_GLOBAL_BATCH:
        raise SpecError(f"--global-batch {f.global_batch:,}: the search takes up to {MAX_GLOBAL_BATCH:,} samples")
    target = parse_target(f.target) if f.target is not None else DEFAULT_TARGET
    model = load_model(f.model)
    check_target(model, target, f.cp)  # before the request's checks warn about anything
    if not model.is_moe and ((f.ep or 1) > 1 or f.etp is not None):
        raise SpecError(f"--ep / --etp with --gpus: model {model.name} has no experts; expert parallelism is "
                        "searched for mixture-of-experts models only (drop --ep / --etp)")
    hw = load_hardware(f.hardware)
    total = cluster_gpus(hw, f.gpus, f.nodes)
    assert total is not None
    where = f"--gpus {f.gpus}" if f.gpus is not None else f"--nodes {f.nodes} x {hw.devices_per_node} per node"
    tp, pp, cp, dp = f.tp, f.pp, f.cp, f.dp
    bad = [f"{flag} {size} does not divide the {total} GPUs"
           for flag, size in (("--tp", tp), ("--cp", cp), ("--pp", pp)) if size is not None and total % size]
    if bad:  # the pin to change, named before any other rule
        raise SpecError(f"{where}: no layout satisfies the pinned options ({'; '.join(bad)})")
    if tp is not None and pp is not None:  # the layout is pinned: CP too (1 unless --cp), DP derived
        cp = cp or 1
        dp = derive_dp(tp, pp, dp, total, where, f.allow_idle_gpus, cp)
        total = tp * cp * pp * dp
    elif dp is not None:
        raise SpecError("--dp with --gpus: DP follows from GPUs / (TP x CP x PP); pin --tp and --pp instead")
    sp, dist_opt = f.sp, f.distributed_optimizer
    if f.overlap_param_gather:  # Megatron's rule: it gathers the distributed optimizer's shards
        if dist_opt is False:
            raise SpecError("--overlap-param-gather needs --distributed-optimizer")
        dist_opt = True
    if f.tp_comm_overlap:  # TransformerEngine's userbuffers overlap the SP collectives
        if sp is False:
            raise SpecError("--tp-comm-overlap needs sequence parallelism (--sp)")
        sp = True
    # the shared request: MoE with a pinned TP > 1 needs SP (Megatron's rule); the search decides SP per candidate
    sp_base = bool(sp) if sp is not None else (tp or 1) > 1 and model.is_moe
    check_ints(**{"--ep": (f.ep, POSITIVE), "--etp": (f.etp, POSITIVE)})
    defaulted = f.precision is None and f.bytes_per_param is None
    if defaulted:  # the search ranks for a framework: its static-memory recipe, not the paper's
        f = replace(f, precision=SEARCH_PRECISION)
    req = search_request(f, total, hw.devices_per_node, sp_base, bool(dist_opt))
    run_search(SearchArgs(f.model, f.hardware, total, f.global_batch, f.seq_len, tp, pp, f.vpp, sp, f.micro_batch,
                          dist_opt, f.method, f.allow_cross_node_tp, f.top, f.as_json, f.out, f.search_png, cp,
                          req.parallel.cp_comm_type if "cp_comm_type" in f.typed else None, f.offload, target,
                          not f.no_production_overlaps, _fsdp_pin(f), f.ep, f.etp, f.jobs,
                          f.search_time_limit or None, defaulted), req)


def _fsdp_pin(f: PlanFlags) -> DpSharding | None:
    """An FSDP named on the command line pins the search's sharding dimension to it."""
    ds = f.dp_sharding()
    if ds.fsdp:
        from lynx.models import load_model

        if load_model(f.model).is_moe:
            raise SpecError(f"--use-torch-fsdp2 / --use-megatron-fsdp with --gpus: {f.model} has expert layers, "
                            "and FSDP with experts is not priced yet; drop the FSDP flag")
        return ds
    if ds.instances > 1:
        raise SpecError("--num-distributed-optimizer-instances with --gpus: give --use-torch-fsdp2 or "
                        "--use-megatron-fsdp too (the search shards with FSDP's replicas)")
    return None


def float8_whole_blocks(model: ModelSpec) -> tuple[str, ...]:
    """The methods a search with torchao's Float8 plans (() without it): blocks kept or recomputed whole, the only
    ones `lynx export torchtitan` writes for Float8Linear (`export.torchtitan.float8_reason`)."""
    return ("none", "full") if model.fp8 is not None and model.fp8.engine is Fp8Engine.TORCHAO else ()


def run_search(a: SearchArgs, base: Request) -> None:
    """Search the space `a` pins with every candidate priced from `base` (its model, hardware and options)."""
    from lynx.export.targets import check_target
    from lynx.search import Pins, Space, search
    from lynx.search.plot import scatter_png
    from lynx.search.prices import Pricer
    from lynx.search.report import explain, result_dict, search_table
    from lynx.search.space import OFFLOAD_METHODS, Stock, cores
    from lynx.search.targets import rank_for_target

    check_target(base.model, a.target, a.cp)
    titan_note = ""
    if a.target is Target.TORCHTITAN and base.model.family == "llama" and base.graph is None:
        from dataclasses import replace

        from lynx.export.torchtitan import TITAN, titan_model

        # torchtitan runs its own block: every candidate priced on its kernels, as its finalists' prices are, and its
        # per-op SelectiveAC a stock candidate (`search.space.TITAN_STOCK_METHODS`)
        base = replace(base, model=titan_model(base.model))
        titan_note = (f"Model {base.model.name} priced on torchtitan's own block (family {TITAN}: its eager kernels), "
                      "the block torchtitan runs for it.")
    hw = base.hardware
    if a.method is not None:
        from lynx.methods import get_method

        fam = get_method(a.method).family  # one clear line for an unknown name
        if fam and base.model.family != fam:  # every candidate would be refused: say why, not "nothing fits"
            raise SpecError(f"--method {a.method} is priced on the {fam} block only; model {base.model.name} is "
                            f"family {base.model.family!r} (--target torchtitan searches a llama on that block)")
    has_link = hw.host() is not None
    if (a.offload or a.method in OFFLOAD_METHODS) and not has_link:
        what = "--offload" if a.offload else f"--method {a.method}"
        raise SpecError(f"{what}: hardware {hw.name!r} has no host link to offload activations over; give host_link "
                        "(d2h_Bps, h2d_Bps, ...) in the hardware file, or plan without offloading")
    if a.offload is not None and a.method is not None:
        raise SpecError("--offload/--no-offload adds the offloading methods to the search's; with --method the "
                        "search plans that method only (use --method lynx-offload)")
    methods: tuple[str, ...] | None = None if a.method is None else (a.method,)
    whole = float8_whole_blocks(base.model)
    if whole and methods is None:  # torchtitan runs Float8 blocks kept or recomputed whole (`export.torchtitan`)
        methods = whole
    elif whole and methods is not None and methods[0] not in whole:
        raise SpecError(f"--method {methods[0]} with --float8-recipe: torchtitan runs Float8 blocks kept or "
                        f"recomputed whole; valid: {', '.join(whole)}")
    space = Space(base.model, hw, a.gpus, a.global_batch, a.seq_len,
                  Pins(tp=a.tp, pp=a.pp, vpp=a.vpp, sp=a.sp, mb=a.mb, dist_opt=a.dist_opt, cp=a.cp,
                       fsdp=True if a.fsdp is not None else None, ep=a.ep, etp=a.etp, methods=methods),
                  a.allow_cross_node_tp, a.cp_comm_type,
                  has_link if a.offload is None else a.offload, a.production_overlaps, fsdp=a.fsdp or FSDP2,
                  stock=Stock.TORCHTITAN if a.target is Target.TORCHTITAN else Stock.MEGATRON)
    layouts, rejected = cores(space)  # every core holds a candidate at least (`space.layout_candidates`)
    if not layouts:  # nothing to search: say which rule the pins break, before any work
        raise SpecError(f"--gpus {a.gpus}: no layout satisfies the pinned options ({no_layout_reason(a, rejected)})")
    from lynx.search.parallel import auto_jobs

    jobs = a.jobs or auto_jobs()
    def rank(res: SearchResult, pricer: Pricer) -> SearchResult:
        # a lynx plan made again without --tp-comm-overlap for lynx's engine, unless the user gave that flag
        return rank_for_target(res, a.target, a.top, pricer, variants=not base.options.tp_comm_overlap)

    # a target's ranking reads lynx's 2 x top fastest: the search plans every candidate that can be among them
    rows = 2 * a.top
    res = _with_progress(lambda cb: search(space, base.options, top=a.top, progress=cb, jobs=jobs,
                                           time_limit_s=a.time_limit_s, rank=rank, rows=rows))
    if a.as_json:
        print_json(result_dict(res) | {"target": a.target.value, "precision": base.options.precision,
                                       "precision_defaulted": a.precision_defaulted})
    else:
        console.print(search_table(res, a.top))
        text = TARGET_TEXT[a.target]
        if base.model.compiled:
            text = text.replace("its eager kernels", "its blocks compiled (--compile)")
        console.print(f"Priced for {a.target.value} (--target): {text}.", soft_wrap=True)
        if a.precision_defaulted:
            console.print(PRECISION_TEXT.format(titan=TITAN_PRECISION if a.target is Target.TORCHTITAN else ""),
                          soft_wrap=True)
        if titan_note:
            console.print(titan_note, soft_wrap=True)
        if whole:
            console.print(f"{base.model.fp8.describe() if base.model.fp8 else ''}: methods {' and '.join(whole)} "
                          "only (torchtitan's AC module keeps or recomputes a Float8 block whole).", soft_wrap=True)
        for line in explain(res):
            console.print(line, soft_wrap=True)
    if a.png is not None and res.considered:
        from lynx.paths import atomic_path

        with atomic_path(a.png, "--search-png") as tmp:
            scatter_png(res, tmp)
        err_console.print(f"wrote {a.png}")
    best = res.best
    if res.stopped:  # on stderr too: a script reading --json or --out learns the pick is not proven the fastest
        err_console.print(f"lynx: the search stopped at --search-time-limit {a.time_limit_s:g} s with "
                          f"{res.unplanned:,} candidates not planned (see the explanation)", soft_wrap=True)
    if best is None:
        what = ("none of the candidates planned before --search-time-limit fits" if res.stopped
                else "no configuration fits the memory budget")
        err_console.print(f"lynx: {what}; no plan written", soft_wrap=True)
        raise typer.Exit(3)
    if a.out is not None and best.plan is not None:
        from lynx.plan import Plan

        Plan.evaluate(best.plan.problem, best.plan.result).save(a.out)
        err_console.print(f"wrote {a.out}")
    FAST_EXIT[0] = True  # everything is written: `lynx.cli.run` need not free the search's caches


TARGET_TEXT = {
    Target.MEGATRON: "the table's top rows are what Megatron-Core runs of `lynx export megatron` (its flags, lynx's "
    "plugin or lynx's engine where the method column says so)",
    Target.TORCHTITAN: "the table's top rows are what torchtitan runs of `lynx export torchtitan` (its eager kernels "
    "and FSDP, lynx's engine or AC module)",
    Target.LYNX: "lynx's own runtime (`lynx train`) runs the lynx rows; stock rows run on Megatron-Core as they are",
}


def no_layout_reason(a: SearchArgs, rejected: list[Rejected]) -> str:
    """Why no candidate is left, the real cause first: a pin that does not divide the GPUs, else the reasons of
    the combinations that got furthest (a batch that does not divide the DP a layout gives comes after the TP
    and PP that allowed that layout, so it is named before the TP sizes the heads refuse)."""
    pinned = [f"{flag} {size} does not divide the {a.gpus} GPUs"
              for flag, size in (("--tp", a.tp), ("--cp", a.cp), ("--pp", a.pp))
              if size is not None and a.gpus % size]
    if pinned:
        return "; ".join(pinned)
    if not rejected:
        return "TP x PP must divide the GPUs and PP must not exceed the layers"
    depth = max(len(r.what.split()) for r in rejected)
    deepest = [r for r in rejected if len(r.what.split()) == depth]
    reasons = list(dict.fromkeys(f"{r.what}: {r.reason}" for r in deepest))
    more = f"; and {len(reasons) - 3} more like these" if len(reasons) > 3 else ""
    return "; ".join(reasons[:3]) + more
PLAIN_EVERY_S = 5.0
"""Seconds between the plain progress lines written when stderr is not a terminal."""


def _with_progress(run: Callable[[Progress], SearchResult]) -> SearchResult:
    """A rich progress bar on stderr while the search runs (transient: gone once it is done); when stderr is not
    a terminal, a plain line (no escape codes) every few seconds and one at the end."""
    if not err_console.is_terminal:
        return run(_plain_progress())
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    with Bar(TextColumn("searching"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=err_console, transient=True) as bar:
        task = bar.add_task("", total=None)

        def cb(done: int, total: int, what: str) -> None:
            if done % 16 == 0 or done == total:  # rich's update is not free; thousands of calls add up
                bar.update(task, completed=done, total=total, description=what)

        return run(cb)


def _plain_progress() -> Progress:
    import sys
    import time

    t0, last = time.perf_counter(), [-PLAIN_EVERY_S]

    def cb(done: int, total: int, what: str) -> None:
        now = time.perf_counter() - t0
        if now - last[0] >= PLAIN_EVERY_S or done == total:
            last[0] = now
            sys.stderr.write(f"lynx: searching: {done}/{total} candidates decided, {now:.0f} s ({what})\n")
            sys.stderr.flush()

    return cb
