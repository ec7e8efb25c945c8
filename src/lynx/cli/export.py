"""`lynx export megatron|torchtitan` and the body of `lynx plan --from-megatron` (docs/export.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from lynx.cli.app import app
from lynx.cli.common import JsonOpt, console, err_console, print_json
from lynx.errors import SpecError
from lynx.export.megatron_args import MegatronCommand, MegatronRun
from lynx.export.pricing import Figures
from lynx.problem import PlanOptions
from lynx.spec import Hardware

if TYPE_CHECKING:
    from lynx.cli.plan_flags import PlanFlags
    from lynx.export.megatron import MegatronExport

export_app = typer.Typer(
    help="Write a plan in a training framework's terms: Megatron-Core arguments and a per-rank plugin, or "
         "torchtitan config pieces and an activation-checkpointing module.",
    no_args_is_help=True,
)
app.add_typer(export_app, name="export")

PlanArg = Annotated[Path, typer.Argument(help="A plan written by `lynx plan --out`.")]
GiB = float(1 << 30)


def _out_dir(out: Path) -> Path:
    from lynx.paths import check_output_dir

    return check_output_dir(out, "--out")


def figures_table(rows: Sequence[Figures], title: str) -> Table:
    t = Table(title=title, title_justify="left", caption="peak: GiB per stage, first stage first; red = over budget",
              caption_justify="left")
    for col in ("configuration", "recomputation", "iter s", "samples/s", "vs lynx", "peak GiB", "fits"):
        t.add_column(col, justify="right" if col in ("iter s", "samples/s", "vs lynx") else "left")
    base = rows[0].samples_per_s if rows else 0.0
    for f in rows:
        peaks = "/".join(f"[red]{s.peak_bytes / GiB:.1f}[/red]" if not s.fits else f"{s.peak_bytes / GiB:.1f}"
                         for s in f.stages)
        t.add_row(f.label, f.setting, f"{f.iteration_time_s:.3f}", f"{f.samples_per_s:.2f}",
                  f"{f.samples_per_s / base:.2f}x" if base else "", peaks,
                  "[green]yes[/green]" if f.fits else "[red]OOM[/red]")
    return t


@export_app.command("megatron")
def megatron_cmd(
    plan_file: PlanArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for the files.")] = Path("lynx-megatron"),
    as_json: JsonOpt = False,
) -> None:
    """Megatron-Core launcher arguments, a per-rank recomputation plugin, and stock Megatron priced beside
    the plan."""
    from lynx.export.megatron import build_megatron, write_megatron
    from lynx.export.source import load_source

    out = _out_dir(out)
    exp = build_megatron(load_source(plan_file))
    paths = write_megatron(exp, out, plan_file)
    plain = _engine_without_userbuffers(exp)
    if as_json:
        extra = {} if plain is None else {"engine_without_tp_comm_overlap_s": plain}
        print_json(exp.to_dict() | extra | {"files": [str(p) for p in paths]})
        return
    console.print("[bold]Megatron-Core arguments[/bold] (stock flags; the plugin refines recomputation per rank):")
    console.print(exp.args_text().rstrip(), markup=False, highlight=False)
    for n in exp.notes:
        console.print(f"  note: {n}", markup=False)
    if exp.figures:
        rows = (*exp.figures, exp.engine) if exp.engine is not None else exp.figures
        console.print(figures_table(rows, f"{plan_file}: predicted by lynx's simulator"))
    else:
        console.print(exp.sim_note)
    if exp.engine_fit is not None and exp.engine_fit.runs:
        from lynx.export.megatron_engine import ENGINE_FILE, spec_line

        flash = exp.source.problem.model.attention == "flash"
        where = " (lynx.integrations.megatron.attention)" if flash else ""
        console.print(f"lynx engine: in the model provider, after building the GPTModel from "
                      f"{spec_line(flash)}{where}: `from {ENGINE_FILE[:-3]} import apply_plan; "
                      f"apply_plan(model, vp_stage=vp_stage)` ({ENGINE_FILE}, no --recompute-* flags)",
                      markup=False, highlight=False)
    if plain is not None:
        console.print(f"lynx engine without --tp-comm-overlap: this layout and method planned again without the flag "
                      f"(the engine builds Megatron-Core's local spec, which has no TransformerEngine userbuffers) run "
                      f"in lynx's engine at {plain:.3f} s; `lynx plan` without --tp-comm-overlap writes that plan, and "
                      "`lynx plan --gpus` ranks it (docs/decisions/0274)", markup=False, highlight=False)
    for k, v in exp.environment:
        console.print(f"environment: export {k}={v}", markup=False, highlight=False)
    for p in paths:
        err_console.print(f"wrote {p}")


def _engine_without_userbuffers(exp: MegatronExport) -> float | None:
    """Where lynx's engine refuses a lynx plan only for --tp-comm-overlap, the engine's price of the same layout and
    method planned again without it (`search.prices.engine_variant`); None otherwise."""
    from lynx.search.prices import engine_variant

    if exp.engine_fit is None or exp.engine_fit.runs:
        return None
    variant = engine_variant(exp.source.problem, exp.source.result)
    if variant is None:
        return None
    from lynx.export.megatron_engine import engine_price

    fig, _ = engine_price(variant.problem, variant.result)
    return None if fig is None else fig.iteration_time_s


@export_app.command("torchtitan")
def torchtitan_cmd(
    plan_file: PlanArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for the files.")] = Path("lynx-torchtitan"),
    as_json: JsonOpt = False,
) -> None:
    """torchtitan config pieces (pipeline degree, modules per model part, schedule CSV) and an
    activation-checkpointing module that applies the plan per transformer block."""
    from lynx.export.source import load_source
    from lynx.export.torchtitan import build_torchtitan, write_torchtitan

    out = _out_dir(out)
    exp = build_torchtitan(load_source(plan_file))
    paths = write_torchtitan(exp, out)
    if as_json:
        print_json(exp.config | {"notes": list(exp.notes), "files": [str(p) for p in paths],
                                 "figures": [f.to_dict() for f in exp.figures], "fits": exp.fits})
        return
    par = exp.config["parallelism"]
    console.print(f"[bold]torchtitan[/bold]: PP {par['pipeline_parallel_degree']}, "
                  f"{len(par['module_fqns_per_model_part'])} model parts, schedule {par['pipeline_parallel_schedule']}")
    layers = exp.ac_table["layers"]
    for i, part in enumerate(par["module_fqns_per_model_part"]):
        ids = [int(f.split(".")[1]) for f in part if f.startswith("layers.")]
        modes = [layers[j]["mode"] for j in ids]
        ac = ", ".join(f"{modes.count(m)} {m}" for m in ("none", "selective", "full") if modes.count(m))
        console.print(f"  part {i}: {part[0]} .. {part[-1]} ({len(part)} modules); blocks: {ac}", markup=False)
    for n in exp.notes:
        console.print(f"  note: {n}", markup=False)
    if exp.figures:
        console.print(figures_table(exp.figures, f"{plan_file}: predicted by lynx's simulator"))
    for p in paths:
        err_console.print(f"wrote {p}")


@dataclass(frozen=True, slots=True)
class LynxFlags:
    """lynx plan's own options that a Megatron command line also sets; given ones win."""

    precision: str | None = None
    """None: what the command line says (--bf16 / --fp16)."""
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False


def derived_dp(dp: int, nodes: int | None, per_node: int, tp: int, pp: int) -> int:
    """DP as Megatron derives it: world size / (TP x PP), the world being `--nodes` x devices per node when
    --nodes is given and --dp is not (--dp 1, the default)."""
    if nodes is None or dp != 1:
        return dp
    world = nodes * per_node
    if world % (tp * pp):
        raise SpecError(f"--nodes {nodes}: {world} devices are not a multiple of TP x CP {tp} x PP {pp} (Megatron "
                        "derives DP = world size / (TP x CP x PP)); give --dp")
    return world // (tp * pp)


def megatron_options(run: MegatronRun, lynx: LynxFlags, bytes_per_param: float | None, nodes: int | None,
                     budget_gb: float | None) -> PlanOptions:
    """PlanOptions for an imported command line: its precision, optimizer and overlaps, lynx's flags on top."""
    from lynx.cost.static_memory import parse_precision

    precision = lynx.precision or run.precision or "fp32"
    return PlanOptions(
        bytes_per_param=bytes_per_param, nodes=nodes, budget_bytes=None if budget_gb is None else budget_gb * GiB,
        precision=parse_precision(precision).value,
        distributed_optimizer=lynx.distributed_optimizer or run.distributed_optimizer,
        overlap_grad_reduce=lynx.overlap_grad_reduce or run.overlap_grad_reduce,
        overlap_param_gather=lynx.overlap_param_gather or run.overlap_param_gather,
        tp_comm_overlap=lynx.tp_comm_overlap or run.tp_comm_overlap, ddp_bucket_size=run.ddp_bucket_size,
        check_for_nan_in_grad=run.check_for_nan_in_grad, ddp_average_in_collective=run.ddp_average_in_collective,
        dp_sharding=run.dp_sharding, optimizer_precision=run.optimizer_precision,
    )


def budget_warnings(budget_gb: float | None, hw: Hardware) -> list[str]:
    """A --budget-gb above what the device has is a typo or a wish: say so (the plan would not fit)."""
    if budget_gb is None or budget_gb * GiB <= hw.device.memory_bytes:
        return []
    return [f"--budget-gb {budget_gb:g} exceeds the {hw.device.name}'s {hw.device.memory_bytes / GiB:.1f} GiB; "
            "plans that use it will not fit on the device"]


_MEGATRON_FLAG = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
                  "cp": "--context-parallel-size", "vpp": "virtual pipeline stages", "sp": "--sequence-parallel",
                  "micro_batch": "--micro-batch-size", "global_batch": "--global-batch-size",
                  "seq_len": "--seq-length", "cp_comm_type": "--cp-comm-type",
                  "ep": "--expert-model-parallel-size", "etp": "--expert-tensor-parallel-size"}


def check_megatron_pins(cmd: MegatronCommand, f: PlanFlags) -> None:
    """lynx's layout options given beside --from-megatron must say what the command line says: a conflict is an
    error naming both (never one silently taken over the other)."""
    from lynx.cli.modes import flag

    if "model" in f.typed:
        raise SpecError(f"--model {f.model} with --from-megatron: the model is the command line's (--num-layers, "
                        "--hidden-size, ...); drop --model")
    theirs = {"tp": cmd.tp, "pp": cmd.pp, "cp": cmd.cp, "vpp": cmd.layout.vpp, "sp": cmd.sequence_parallel,
              "micro_batch": cmd.micro_batch_size, "global_batch": cmd.global_batch_size, "seq_len": cmd.seq_length,
              "cp_comm_type": cmd.cp_comm_type, "ep": cmd.ep, "etp": cmd.etp or cmd.tp}  # ETP unset: TP
    for name, value in theirs.items():
        mine = getattr(f, name)
        if name in f.typed and mine != value:
            shown = ("on" if value else "off") if isinstance(value, bool) else value
            raise SpecError(f"{flag(name)} {('on' if mine else 'off') if isinstance(mine, bool) else mine} conflicts "
                            f"with --from-megatron's {_MEGATRON_FLAG[name]} {shown}; give the size in one place")


def megatron_command_text(value: str) -> str:
    """--from-megatron's value: a quoted command line, or the path of a file holding one (what `lynx export
    megatron` writes as megatron_args.txt), read whole. A value with no flag that names no file is refused."""
    if any(t.startswith("--") for t in value.split()):
        return value
    path = Path(value.strip()).expanduser()
    if not path.is_file():
        raise SpecError(f"--from-megatron: {value!r} has no Megatron flag and is not a file; give the command line "
                        "quoted (\"--num-layers 32 ...\") or the path of a file holding it (megatron_args.txt)")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"--from-megatron: cannot read {path}: {e}") from None


def plan_from_megatron_flags(f: PlanFlags) -> None:
    """`lynx plan --from-megatron "ARGS"` with lynx's own options (which win over the command line's)."""
    from lynx.export.megatron_args import parse_megatron_args

    cmd = parse_megatron_args(megatron_command_text(str(f.from_megatron)))
    check_megatron_pins(cmd, f)
    given = LynxFlags(f.precision, bool(f.distributed_optimizer), f.overlap_grad_reduce, f.overlap_param_gather,
                      f.tp_comm_overlap)
    plan_from_megatron(cmd, f.hardware, f.dp, f.nodes, f.budget_gb, f.bytes_per_param, f.as_json, f.out, given)


def megatron_world(cmd: MegatronCommand, dp: int | None, nodes: int | None, hw: Hardware
                   ) -> tuple[int, int | None, list[str]]:
    """(DP, nodes, warnings) of an imported command line: torchrun's --nnodes x --nproc-per-node when the line
    starts with it (Megatron's DP = world / (TP x CP x PP)), lynx's --dp / --nodes otherwise; a --dp or --nodes
    that disagrees with torchrun's is an error naming both, and no world anywhere prices DP 1, said."""
    mp = cmd.tp * cmd.cp * cmd.pp
    run = cmd.launcher
    if run is not None and run.nodes is None and dp is None and nodes is None:
        raise SpecError(f"--from-megatron: torchrun --nnodes {run.elastic} is elastic; give lynx --nodes or --dp for "
                        "the world lynx should price")
    if run is None or run.nodes is None:  # no launch line, or an elastic one: the world is lynx's --dp / --nodes
        warn = [] if dp is not None or nodes is not None else [
            "DP 1: Megatron takes DP from the launcher's world size (torchrun --nnodes x --nproc-per-node), which "
            "the command line does not hold; give --dp or --nodes, or the torchrun line"]
        return derived_dp(1 if dp is None else dp, nodes, hw.devices_per_node, cmd.tp * cmd.cp, cmd.pp), nodes, warn
    per = run.procs_per_node or hw.devices_per_node
    if per != hw.devices_per_node:
        raise SpecError(f"--from-megatron: torchrun --nproc-per-node {per} on {hw.name} ({hw.devices_per_node} "
                        "devices a node): lynx prices whole nodes; give --dp and --nodes")
    if nodes is not None and nodes != run.nodes:
        raise SpecError(f"--nodes {nodes} conflicts with --from-megatron's torchrun --nnodes {run.nodes}; give the "
                        "size in one place")
    world = run.nodes * per
    if world % mp:
        raise SpecError(f"--from-megatron: torchrun's {run.nodes} x {per} = {world} devices are not a multiple of "
                        f"TP x CP {cmd.tp * cmd.cp} x PP {cmd.pp} (Megatron derives DP = world size / (TP x CP x PP))")
    if dp is not None and dp != world // mp:
        raise SpecError(f"--dp {dp} conflicts with --from-megatron's torchrun world ({run.nodes} x {per} = {world} "
                        f"devices: DP {world // mp}); give the size in one place")
    return world // mp, run.nodes, []


def plan_from_megatron(cmd: MegatronCommand, hardware: str, dp: int | None, nodes: int | None,
                       budget_gb: float | None, bytes_per_param: float | None, as_json: bool, out: Path | None,
                       lynx: LynxFlags | None = None) -> None:
    """Simulate the user's Megatron configuration and lynx's plan for the same model, cluster and batch.
    `lynx`: lynx's own options, which win over the command line's."""
    from dataclasses import replace

    from lynx.export.pricing import imported_problem, plan_method, simulate_stock
    from lynx.spec import load_hardware

    if budget_gb is not None and budget_gb <= 0:
        raise SpecError(f"--budget-gb must be positive, got {budget_gb}")
    hw = load_hardware(hardware)
    dp, nodes, world_warnings = megatron_world(cmd, dp, nodes, hw)
    cmd = replace(cmd, warnings=(*cmd.warnings, *world_warnings))
    opts = megatron_options(cmd.run, lynx or LynxFlags(), bytes_per_param, nodes, budget_gb)
    problem = imported_problem(cmd.model, cmd.parallel(dp), cmd.layout, hardware, opts)
    for w in budget_warnings(budget_gb, hw):  # after the checks: a NaN has been refused
        err_console.print(f"[yellow]warning:[/yellow] {w}", highlight=False)
    for w in cmd.warnings:  # before the pricing, whose error (a plan that does not fit) they may explain
        err_console.print(f"[yellow]warning:[/yellow] {w}", highlight=False)
    from lynx.export.megatron_offload import command_offload

    mine = simulate_stock(problem, cmd.layout, cmd.recompute,
                          command_offload(cmd.offload, len(cmd.layout.layers), cmd.layout.pp))
    free = replace(problem, options=replace(problem.options, layers_per_stage=None))
    try:
        lynx_row: Figures | None = plan_method(free, "lynx")
        why = ""
    except SpecError as e:  # lynx's partitions put a layer in every virtual stage; Megatron's ends may hold none
        lynx_row, why = None, str(e).splitlines()[0]
    if out is not None and mine.plan is not None:
        mine.plan.save(out)
        err_console.print(f"wrote {out}")
    if as_json:
        print_json({"megatron": mine.to_dict(), "lynx": None if lynx_row is None else lynx_row.to_dict(),
                    **({"lynx_not_planned": why} if why else {}), "warnings": list(cmd.warnings)})
        return
    off = "" if cmd.offload is None else (
        f"; offload {' '.join(cmd.offload['offload_modules'])} fraction {cmd.offload['activation_offload_fraction']:g}")
    mine_row = replace(mine, label="your megatron", setting=f"{mine.setting}{off}; layers {_runs(cmd.layout.layers)}")
    fp8 = f"; {cmd.model.fp8.describe()}" if cmd.model.fp8 is not None else ""
    rows = [mine_row] if lynx_row is None else [lynx_row, mine_row]
    console.print(figures_table(rows, f"Megatron command line on {hardware}, DP {dp}{fp8}"))
    if why:
        err_console.print(f"[yellow]note:[/yellow] lynx's own plan of this layout: {why}", highlight=False)


def _runs(layers: tuple[int, ...]) -> str:
    """Layers per virtual stage with repeats folded: (1, 2, 2, 2, 1) reads '1, 2 x 3, 1'."""
    out: list[str] = []
    i = 0
    while i < len(layers):
        j = i
        while j < len(layers) and layers[j] == layers[i]:
            j += 1
        out.append(f"{layers[i]}" if j - i == 1 else f"{layers[i]} x {j - i}")
        i = j
    return ", ".join(out)
