"""`lynx export megatron`: a plan as Megatron-Core launcher arguments, a per-rank plugin, and the price of
what stock Megatron cannot express (docs/export.md)."""

from __future__ import annotations

import pprint
import shlex
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from lynx.errors import LynxError
from lynx.export.layout import first_last_counts, megatron_layout
from lynx.export.megatron_engine import (
    ENGINE_ARGS_FILE,
    ENGINE_FILE,
    OFFLOAD_ENV,
    PLAN_COPY,
    EngineFit,
    engine_args,
    engine_module,
    engine_price,
)
from lynx.export.megatron_fsdp import sharding_flags
from lynx.export.megatron_model import model_flags
from lynx.export.megatron_moe import parallel_flags as expert_parallel_flags
from lynx.export.megatron_offload import offload_entry, offload_flags, offload_notes
from lynx.export.megatron_optimizer import optimizer_flags
from lynx.export.megatron_recompute import MegatronRecompute, chunk_setting, collapse, hidden_note
from lynx.export.pricing import (
    Figures,
    fastest_fitting,
    fastest_fitting_global,
    simulate_lynx,
    simulate_per_stage,
    simulate_stock,
    stock_on_even_split,
)
from lynx.export.source import ExportSource
from lynx.methods.rules import megatron_stock, recompute_modules
from lynx.problem import PlanOptions
from lynx.spec import ParallelSpec

ARGS_FILE = "megatron_args.txt"
PLUGIN_FILE = "lynx_megatron_plugin.py"
REPORT_FILE = "megatron_report.json"
_PLAN_MARKER = "LYNX_PLAN: dict[str, Any] = {}  # lynx:plan-table (filled in by `lynx export megatron`)"


@dataclass(frozen=True, slots=True)
class MegatronExport:
    source: ExportSource
    args: tuple[tuple[str, ...], ...]
    """One flag with its values per entry, in launcher order."""
    per_stage: tuple[MegatronRecompute, ...]
    """The plugin's setting per virtual stage."""
    stock: MegatronRecompute
    notes: tuple[str, ...]
    figures: tuple[Figures, ...]
    """lynx's plan, Megatron with the plugin, stock Megatron on the exported layout, and stock Megatron on its
    own even split when Megatron accepts one (empty when the layout cannot be simulated)."""
    sim_note: str = ""
    engine: Figures | None = None
    """The plan as lynx's engine inside Megatron-Core runs it (`export.megatron_engine`); None when it cannot."""
    engine_fit: EngineFit | None = None
    environment: tuple[tuple[str, str], ...] = ()
    """Environment variables the exported run needs (name, value)."""

    def args_text(self) -> str:
        """One flag per line, shell-quoted: paste into a launcher or `lynx plan --from-megatron "$(cat ...)"`."""
        return "\n".join(" ".join(shlex.quote(t) for t in flag) for flag in self.args) + "\n"

    def argv(self) -> list[str]:
        return [t for flag in self.args for t in flag]

    def plugin_table(self) -> dict[str, Any]:
        lay = self.source.layout
        stages = []
        for v, rec in enumerate(self.per_stage):
            off = offload_entry(self.source.problem.graph, self.source.policies[v]) \
                if v < len(self.source.policies) else {}
            stages.append({"virtual_stage": v, "pp_rank": v % lay.pp, "vp_rank": v // lay.pp,
                           "num_layers": lay.layers[v], "first_layer": lay.first_layer(v), **rec.to_dict(), **off})
        return {"pp": lay.pp, "vpp": lay.vpp, "num_layers": lay.num_layers, "method": self.source.result.method,
                "stages": stages}

    def to_dict(self) -> dict[str, Any]:
        fit = self.engine_fit
        engine = {"runs": fit.runs, "why_not": fit.why_not, "cooldown_window": fit.cooldown,
                  "figures": self.engine.to_dict() if self.engine is not None else None} if fit else None
        return {"args": self.argv(), "stock": self.stock.to_dict(), "plugin": self.plugin_table(),
                "notes": list(self.notes), "figures": [f.to_dict() for f in self.figures],
                "simulation_note": self.sim_note, "engine": engine, "environment": dict(self.environment)}


def _translation(src: ExportSource) -> tuple[list[MegatronRecompute], MegatronRecompute, list[str], list[str]]:
    """Each (virtual) stage's Megatron setting translated from lynx's keep sets, the one stock setting they
    collapse to, the notes on what Megatron cannot express, and the rounding notes."""
    graph, lay = src.problem.graph, src.layout
    per_stage: list[MegatronRecompute] = []
    notes: list[str] = []
    rounding: list[str] = []
    for v, pol in enumerate(src.policies):
        where = f"stage {v}" if lay.vpp == 1 else f"virtual stage {v}"
        rec, n = chunk_setting(src.problem.range_graphs(lay.first_layer(v), lay.layers[v]), pol, where)
        per_stage.append(rec)
        rounding += n
        notes += hidden_note(pol, where)
        notes += offload_notes(graph, pol, where)
    stock, n = collapse(per_stage, lay.layers)
    return per_stage, stock, notes, rounding + n


def megatron_run(src: ExportSource) -> tuple[Figures, bool]:
    """What Megatron-Core runs of `lynx export megatron`: its flags with the plugin's per-stage settings (the
    export table's "megatron+plugin" row, `--target megatron`'s price), and whether the plugin is needed (a
    setting that differs between stages, or offloading other than the global flags'; else the stock flags alone
    run it)."""
    rounded, stock, _, _ = _translation(src)
    offload = _offload_entries(src)
    per_stage, stock, _ = _fit(src, rounded, stock, offload)
    fig = simulate_per_stage(src.problem, src.layout, per_stage, offload[0])
    return fig, offload[0] != offload[1] or any(s != stock for s in per_stage)


PAPER_PRECISION_NOTE = (
    "precision: this plan priced the paper's static memory (--precision paper: 16 B/param, 16-bit gradients); "
    "Megatron-Core under --bf16 keeps fp32 main gradients (18 B/param, 6 + 12/DP with --use-distributed-optimizer), "
    "so its stages hold more than the figures here: plan with --precision megatron-bf16 to price what it runs")
"""The default recipe is the paper's (to reproduce its figures); no Megatron-Core flag runs it."""


def build_megatron(src: ExportSource, simulate: bool = True) -> MegatronExport:
    graph, lay, par = src.problem.graph, src.layout, src.problem.parallel
    rounded, stock, notes, rounding = _translation(src)
    per_stage = list(rounded)
    figures: tuple[Figures, ...] = ()
    sim_note = "not simulated: not asked to"
    offload = _offload_entries(src)
    if simulate:
        try:
            per_stage, stock, more = _fit(src, rounded, stock, offload)
            figures = (simulate_lynx(src.problem, src.result),
                       simulate_per_stage(src.problem, lay, per_stage, offload[0]),
                       simulate_stock(src.problem, lay, stock, offload[1]))
            even, why = stock_on_even_split(src.problem, lay)
            figures += (even,) if even is not None else ()
            notes, sim_note = notes + more + ([why] if why else []), ""
        except LynxError as e:
            sim_note = f"not simulated: {e}"
    if not figures:  # the plugin and stock flags are then translations of lynx's keep sets
        per_stage, stock = rounded, collapse(rounded, lay.layers)[0]
        notes += rounding
    args: list[tuple[str, ...]] = [
        ("--tensor-model-parallel-size", str(par.tp)), ("--pipeline-model-parallel-size", str(par.pp)),
        *([("--sequence-parallel",)] if par.sequence_parallel else []),
        *cp_flags(par), *expert_parallel_flags(par),
        ("--pipeline-model-parallel-layout", megatron_layout(lay)),
        ("--micro-batch-size", str(par.micro_batch_size)), ("--global-batch-size", str(par.global_batch_size)),
        *model_flags(src.problem.model, par.seq_length), *run_flags(src.problem.options, par),
        *_as_flags(stock.flags()),
        *offload_flags([offload_entry(graph, pol) for pol in src.policies]),
    ]
    if src.problem.options.precision == "paper":
        notes.append(PAPER_PRECISION_NOTE)
    fl = first_last_counts(lay)
    if fl is not None:
        notes.append(f"layout alternative: --decoder-first-pipeline-num-layers {fl[0]} "
                     f"--decoder-last-pipeline-num-layers {fl[1]}")
    env = tuple(OFFLOAD_ENV.items()) if any(f[0] == "--fine-grained-activation-offloading" for f in args) else ()
    if env:
        notes.append("environment: " + " ".join(f"{k}={v}" for k, v in env) + " with the plugin's offloading "
                     "(Megatron-Core's activation offloading with TransformerEngine >= 2.10 needs TE's first "
                     "offloading implementation; lynx's engine offloads by itself and needs neither)")
    engine, fit = engine_price(src.problem, src.result) if simulate else (None, None)
    if fit is not None:
        notes += list(fit.notes) if fit.runs else [f"lynx engine ({ENGINE_FILE}): cannot run this plan: {fit.why_not}"]
    return MegatronExport(src, tuple(args), tuple(per_stage), stock, tuple(notes), figures, sim_note, engine, fit,
                          env)


def _offload_entries(src: ExportSource) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
    """(each virtual stage's plugin offload entry, the global flags' entry on every stage: the union of the
    modules at fraction 1), or (None, None) when the plan does not offload."""
    per = [offload_entry(src.problem.graph, pol) for pol in src.policies]
    if not any(per):
        return None, None
    mods = [m for flag in offload_flags(per) if flag[0] == "--offload-modules" for m in flag[1:]]
    glob = {"fine_grained_activation_offloading": True, "offload_modules": mods, "activation_offload_fraction": 1.0}
    return per, [glob] * len(per)


def stock_setting(method: str, collapsed: MegatronRecompute) -> MegatronRecompute:
    """A stock method's own Megatron setting: its --recompute-modules as the method names them (the translation of
    its keep sets names the fewest modules that drop the same tensors, none at all for core_attn over flash
    attention, which keeps nothing either way, though Megatron re-runs it), else what its per-stage translations
    collapse to (full, uniform, block: their layer counts are the plan's)."""
    mods = ("core_attn",) if method == "selective" else recompute_modules(method)
    return collapsed if mods is None else MegatronRecompute("selective", modules=mods)


def _fit(src: ExportSource, rounded: list[MegatronRecompute], collapsed: MegatronRecompute,
         offload: tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None] = (None, None)
         ) -> tuple[list[MegatronRecompute], MegatronRecompute, list[str]]:
    """Megatron cannot keep lynx's exact op sets, so each stage gets the fastest setting Megatron can express
    that the simulator says fits (the rounded translation is the fallback); stock Megatron gets the fastest
    single setting that fits every stage. `offload`: the plugin's and the global flags' offloading, priced
    with them (`_offload_entries`)."""
    if megatron_stock(src.result.method):
        # a plan of Megatron's own flags is exported as planned, on every stage the one setting its per-stage
        # translations collapse to: a faster setting that fits is another configuration, which the search prices as
        # its own candidate (decision 0278)
        own = stock_setting(src.result.method, collapsed)
        return [own] * len(rounded), own, []
    notes: list[str] = []
    word = "stage" if src.layout.vpp == 1 else "virtual stage"
    per_stage, found = fastest_fitting(src.problem, src.layout, rounded, offload[0])
    for v, (a, b, ok) in enumerate(zip(rounded, per_stage, found, strict=True)):
        if not ok:
            notes.append(f"{word} {v}: no Megatron setting fits; kept the translation {a.short()}")
        elif a != b:
            notes.append(f"{word} {v}: plugin uses {b.short()}, the fastest Megatron setting that fits "
                         f"(the translation of lynx's keep set would be {a.short()})")
    stock = fastest_fitting_global(src.problem, src.layout, offload[1])
    if stock is None:
        notes.append(f"stock: no single setting fits every stage; showing the most frugal translation "
                     f"{collapsed.short()}")
        stock = collapsed
    elif all(found):  # the plugin can always express the stock setting: never hand out a slower one
        mine = simulate_per_stage(src.problem, src.layout, per_stage, offload[0])
        if simulate_stock(src.problem, src.layout, stock, offload[1]).iteration_time_s < mine.iteration_time_s:
            notes.append(f"plugin: the per-stage choice simulates slower than {stock.short()} everywhere; "
                         "using that on every rank")
            per_stage = [stock] * len(per_stage)
    return per_stage, stock, notes


def cp_flags(par: ParallelSpec) -> list[tuple[str, ...]]:
    """Context parallelism as Megatron-LM's arguments name it (megatron/training/arguments.py:
    --context-parallel-size, --cp-comm-type, --hierarchical-context-parallel-sizes); nothing without CP."""
    if par.cp <= 1:
        return []
    out: list[tuple[str, ...]] = [("--context-parallel-size", str(par.cp)), ("--cp-comm-type", par.cp_comm_type)]
    if par.cp_comm_type == "a2a+p2p":
        out.append(("--hierarchical-context-parallel-sizes", str(par.cp_a2a_size), str(par.cp // par.cp_a2a_size)))
    return out


def run_flags(opts: PlanOptions, par: ParallelSpec) -> list[tuple[str, ...]]:
    """The flags for what the plan assumes beyond the model: precision, the distributed optimizer, the
    overlaps (a plan priced with them is only right when Megatron runs them)."""
    out: list[tuple[str, ...]] = [("--fp16",) if opts.precision == "megatron-fp16" else ("--bf16",)]
    if opts.precision == "fp32":
        out = []
    if opts.distributed_optimizer:
        out.append(("--use-distributed-optimizer",))
    if opts.overlap_grad_reduce:
        out.append(("--overlap-grad-reduce",))
    if opts.overlap_param_gather:
        out.append(("--overlap-param-gather",))
    if opts.tp_comm_overlap and par.sequence_parallel:
        out.append(("--tp-comm-overlap",))
    if opts.ddp_bucket_size is not None:
        out.append(("--ddp-bucket-size", str(opts.ddp_bucket_size)))
    if not opts.check_for_nan_in_grad:
        out.append(("--no-check-for-nan-in-loss-and-grad",))
    if opts.ddp_average_in_collective:
        out.append(("--ddp-average-in-collective",))
    out += optimizer_flags(opts.optimizer_precision)
    return out + [f for f in sharding_flags(opts.dp_sharding, par.pp) if f not in out]


def _as_flags(tokens: list[str]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for t in tokens:
        if t.startswith("--"):
            out.append((t,))
        else:
            out[-1] = (*out[-1], t)
    return out


def render_plugin(table: dict[str, Any]) -> str:
    src = (resources.files("lynx.export") / "megatron_plugin.py").read_text()
    if _PLAN_MARKER not in src:
        raise RuntimeError("lynx.export.megatron_plugin lost its plan-table marker")
    body = pprint.pformat(table, width=110, sort_dicts=False)
    return src.replace(_PLAN_MARKER, f"# written by `lynx export megatron`\nLYNX_PLAN: dict[str, Any] = {body}")


def write_megatron(exp: MegatronExport, out_dir: Path, plan_file: Path | None = None) -> list[Path]:
    """The arguments, the plugin, the report; with `plan_file`, also lynx's engine hook-up
    (`export.megatron_engine`: the module the model provider imports, and the plan it reads, copied)."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    files = {ARGS_FILE: exp.args_text(), PLUGIN_FILE: render_plugin(exp.plugin_table()),
             REPORT_FILE: json.dumps(exp.to_dict(), indent=2) + "\n"}
    if plan_file is not None and (exp.engine_fit is None or exp.engine_fit.runs):
        lay = exp.source.layout
        files[PLAN_COPY] = Path(plan_file).read_text()
        files[ENGINE_FILE] = engine_module(PLAN_COPY, exp.source.family, lay.pp, lay.vpp,
                                           exp.source.problem.model.attention == "flash")
        files[ENGINE_ARGS_FILE] = "\n".join(" ".join(shlex.quote(t) for t in f) for f in engine_args(exp.args)) + "\n"
    paths = []
    for name, text in files.items():
        p = out_dir / name
        p.write_text(text)
        paths.append(p)
    return paths
