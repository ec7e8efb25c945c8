"""`lynx profile`: measure one transformer layer into the profile store; `list`, `show`, `export`,
`calibrate` read it back. Measuring needs torch (imported only when measuring)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from lynx.cli.app import app
from lynx.cli.common import (
    JSON_FORMATS,
    JsonOpt,
    MbOpt,
    ModelOpt,
    SeqOpt,
    SpOpt,
    TpOpt,
    check_floats,
    check_ints,
    check_outputs,
    console,
    err_console,
    print_json,
)
from lynx.paths import check_output, write_text
from lynx.profile.store import ProfileRecord, ProfileStore, default_db_path
from lynx.validate import NON_NEGATIVE, POSITIVE, Range

profile_app = typer.Typer(
    help="Measure one real transformer layer into a LayerGraph and keep it in the profile store.\n\n"
         "`lynx profile --model gpt-300m --micro-batch 2 --seq-len 256 --tp 1` measures; `lynx plan --profile ID` "
         "plans from the result.",
    no_args_is_help=False,
)
app.add_typer(profile_app, name="profile")

DbOpt = Annotated[Path | None, typer.Option("--db", help=f"Profile database (default {default_db_path()}).")]
IdArg = Annotated[str, typer.Argument(help="Profile ID (see `lynx profile list`) or 'latest'.")]
MiB = float(1 << 20)


@profile_app.callback(invoke_without_command=True)
def profile_cmd(
    ctx: typer.Context,
    model: ModelOpt = "gpt-300m",
    micro_batch: MbOpt = 1,
    seq_len: SeqOpt = 512,
    tp: TpOpt = 1,
    sp: SpOpt = False,
    hidden: Annotated[int | None, typer.Option("--hidden", help="Override the model's hidden size.")] = None,
    heads: Annotated[int | None, typer.Option("--heads", help="Override the number of attention heads.")] = None,
    ffn: Annotated[int | None, typer.Option("--ffn", help="Override the MLP width (default 4 x hidden).")] = None,
    dtype: Annotated[str, typer.Option(help="fp32, bf16 or fp16.")] = "fp32",
    device: Annotated[str, typer.Option(help="cpu, cuda or auto.")] = "auto",
    warmup: Annotated[int, typer.Option(help="Untimed passes first.")] = 2,
    repeats: Annotated[int, typer.Option(help="Timed passes (median and spread over these).")] = 10,
    threads: Annotated[int, typer.Option(help="CPU threads per rank (0: cores / TP).")] = 0,
    rendezvous: Annotated[str | None, typer.Option(help="HOST:PORT for the TP ranks to meet (default: a free "
                                                   "port on 127.0.0.1).")] = None,
    timeout: Annotated[float, typer.Option(help="Process-group timeout, seconds (rendezvous and collectives).")] = 60.0,
    db: DbOpt = None,
    store: Annotated[bool, typer.Option("--store/--no-store", help="Keep the result in the database.")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Measure one layer (forward, input- and weight-gradient time, bytes, dependencies) and store it."""
    if ctx.invoked_subcommand is not None:
        return
    from lynx.runtime.launch import quiet_torch_logs

    quiet_torch_logs()  # before the profiler imports torch: its C++ logs only with --debug
    from lynx.models import load_model
    from lynx.profile.profiler import ProfileConfig, prepare, profile

    check_ints(**{"--hidden": (hidden, POSITIVE), "--heads": (heads, POSITIVE), "--ffn": (ffn, POSITIVE),
                  "--micro-batch": (micro_batch, POSITIVE), "--seq-len": (seq_len, POSITIVE), "--tp": (tp, POSITIVE),
                  "--warmup": (warmup, Range(ge=0, le=10_000)), "--repeats": (repeats, Range(gt=0, le=10_000)),
                  "--threads": (threads, NON_NEGATIVE)})
    check_floats(**{"--timeout": (timeout, Range(gt=0, le=86400))})
    if store:
        _check_db_writable(db)
    m = load_model(model)
    h = hidden or m.hidden_size
    a = heads or m.num_attention_heads
    f = ffn or (4 * h if hidden and not ffn else m.ffn_hidden_size)
    name = m.name if (hidden, heads, ffn) == (None, None, None) else f"{m.name}[h{h},a{a},f{f}]"
    groups = m.num_query_groups if a % m.num_query_groups == 0 else a
    cfg = ProfileConfig(model=name, hidden_size=h, num_attention_heads=a, ffn_hidden_size=f, seq_length=seq_len,
                        micro_batch_size=micro_batch, tp=tp, sequence_parallel=sp, dtype=dtype, device=device,
                        dropout_p=m.hidden_dropout if m.dropout else 0.0, warmup=warmup, repeats=repeats,
                        threads=threads, family=m.family, num_query_groups=groups)
    prepare(cfg)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("profiling {task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err_console, transient=True,
                  disable=not err_console.is_terminal) as bar:
        task = bar.add_task(f"{name} TP {tp}", total=warmup + repeats)
        res = profile(cfg, lambda done, total: bar.update(task, completed=done, total=total), rendezvous, timeout)
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 reports
        return
    pid = None
    if store:
        from lynx.profile.store import save_profile

        pid = save_profile(db, res.graph, res.info, res.ops, res.extra)
    if pid is not None:
        with ProfileStore.open(db) as st:
            rec = st.get(pid)
    else:
        rec = ProfileRecord(0, res.info, res.graph, res.ops, res.extra)
    if as_json:
        print_json(rec.to_dict())
        return
    _print_record(rec)
    where = f"stored as profile {pid} in {db or default_db_path()}" if pid is not None else "not stored"
    console.print(f"{where} ({res.info.wall_s:.1f} s)")


def _check_db_writable(db: Path | None) -> None:
    """Before measuring: the database the result goes to is ours and writable (or can be created)."""
    p = db or default_db_path()
    if p.exists():
        with ProfileStore.open(p):  # a foreign or corrupt file fails here, in a millisecond
            pass
        check_output(p, "--db")
    elif db is not None:
        check_output(db, "--db")


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def _pm(x: float, spread: float) -> str:
    return f"{x * 1e3:.1f}±{spread * 1e3:.1f}"


def _print_record(rec: ProfileRecord) -> None:
    g, i, e = rec.graph, rec.info, rec.extra
    m = g.meta
    console.print(f"[bold]profile {rec.id}[/bold]: {i.model} hidden {m.hidden_size}, {m.num_attention_heads} heads, "
                  f"ffn {m.ffn_hidden_size}, seq {m.seq_length}, micro-batch {m.micro_batch_size}, TP {m.tp}"
                  f"{' SP' if m.sequence_parallel else ''}, {i.dtype} on {i.device} ({i.threads} threads), "
                  f"torch {i.torch_version}, {i.repeats} repeats after {i.warmup} warm-up, {i.created_at}")
    t = Table(title="per op: median±spread (half the 10-90 percentile range) in ms; MiB per rank")
    for col in ("op", "fwd", "dgrad", "wgrad", "out", "mask", "saved meas/graph", "backward reads"):
        t.add_column(col, justify="left" if col in ("op", "backward reads") else "right")
    for op, s in zip(g.ops, rec.ops, strict=True):
        ok = abs(s.saved_bytes - s.expected_saved_bytes) <= 0.02 * max(s.expected_saved_bytes, 1.0)
        t.add_row(op.name + (" (comm)" if op.is_comm else ""), _pm(s.fwd_s, s.fwd_spread_s),
                  _pm(s.dgrad_s, s.dgrad_spread_s), _pm(s.wgrad_s, s.wgrad_spread_s) if s.wgrad_s else "-",
                  f"{op.out_bytes / MiB:.2f}", f"{op.mask_bytes / MiB:.2f}" if op.mask_bytes else "-",
                  f"{s.saved_bytes / MiB:.2f}/{s.expected_saved_bytes / MiB:.2f} "
                  + ("[green]ok[/green]" if ok else "[red]DIFF[/red]"), ",".join(op.saved) or "-")
    console.print(t)
    console.print(f"layer (sums over ops) forward {_ms(e.get('layer_fwd_s', 0))} ± "
                  f"{_ms(e.get('layer_fwd_spread_s', 0))} ms, "
                  f"backward {_ms(e.get('layer_bwd_s', 0))} ± {_ms(e.get('layer_bwd_spread_s', 0))} ms; "
                  f"saved bytes: layer input {e.get('input_saved_bytes', 0) / MiB:.2f} MiB "
                  f"(graph {e.get('input_expected_bytes', 0) / MiB:.2f}), total "
                  f"{(sum(s.saved_bytes for s in rec.ops) + e.get('input_saved_bytes', 0)) / MiB:.2f} MiB (graph "
                  f"{(sum(s.expected_saved_bytes for s in rec.ops) + e.get('input_expected_bytes', 0)) / MiB:.2f})")
    frac = e.get("disturbed_fraction", 0.0)
    if frac:
        console.print(f"{frac:.0%} of the timed samples saw the OS preempt the profiler; they are left out "
                      "wherever 3 clean samples remain (docs/profiling.md)")
    if frac > 0.5:
        err_console.print("[yellow]warning[/yellow]: the machine is busy and the timings are unreliable; profile "
                          "on a quiet machine, or with --threads 1 to stop waiting on descheduled threads")
    bad = e.get("saved_mismatch") or []
    if bad:
        err_console.print(f"[yellow]warning[/yellow]: saved bytes differ from the LayerGraph accounting by more "
                          f"than 2% for {', '.join(bad)} (see docs/profiling.md)")


@profile_app.command("list")
def list_cmd(db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """List the stored profiles."""
    with ProfileStore.open(db) as st:
        rows = st.summaries()
    if as_json:
        from dataclasses import asdict

        print_json([asdict(r) for r in rows])
        return
    t = Table(title=f"profiles in {db or default_db_path()}")
    for col in ("id", "created (UTC)", "model", "shape", "batch", "layout", "dtype", "device", "fwd ms", "bwd ms"):
        t.add_column(col)
    for r in rows:
        t.add_row(str(r.id), r.created_at[:16].replace("T", " "), r.model,
                  f"h{r.hidden_size} a{r.num_attention_heads} f{r.ffn_hidden_size}",
                  f"s{r.seq_length} b{r.micro_batch_size}", f"TP{r.tp}{' SP' if r.sequence_parallel else ''}",
                  r.dtype, r.device.removeprefix("cpu: "), _ms(r.fwd_s), _ms(r.bwd_s))
    console.print(t)


@profile_app.command("show")
def show_cmd(profile_id: IdArg, db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Show one stored profile op by op."""
    with ProfileStore.open(db) as st:
        rec = st.get(profile_id)
        cals = st.calibrations(rec.id)
    if as_json:
        print_json(rec.to_dict() | {"calibrations": cals})
        return
    _print_record(rec)
    for c in cals:
        console.print(f"calibration {c['id']} ({c['created_at']}, {c['hardware']}): {c['params']}")


@profile_app.command("export")
def export_cmd(
    profile_id: IdArg,
    db: DbOpt = None,
    as_json: JsonOpt = True,
    graph_only: Annotated[bool, typer.Option("--graph-only", help="Only the LayerGraph (the `lynx graph` "
                                             "format).")] = False,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write to a file instead of stdout.")] = None,
) -> None:
    """Export a stored profile as JSON (the whole record, or --graph-only)."""
    import json

    check_outputs(**{"--out": (out, JSON_FORMATS)})
    with ProfileStore.open(db) as st:
        rec = st.get(profile_id)
    text = json.dumps(rec.graph.to_dict() if graph_only else rec.to_dict(), indent=2)
    if out is not None:
        write_text(out, text + "\n", "--out")
        err_console.print(f"wrote {out}")
    else:
        typer.echo(text)


@profile_app.command("calibrate")
def calibrate_cmd(
    profile_id: IdArg,
    db: DbOpt = None,
    hardware: Annotated[str | None, typer.Option("--hardware", "-H", help="Hardware preset or YAML whose "
                                                 "peaks the factors scale (default: the peaks measured "
                                                 "with the profile).")] = None,
    save: Annotated[bool, typer.Option("--save/--no-save", help="Keep the fitted factors in the database.")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Fit the cost model's efficiency factors to a stored profile; per op predicted vs measured."""
    from lynx.profile.calibrate import calibrate, report_table

    with ProfileStore.open(db) as st:
        rec = st.get(profile_id)
        if save:
            st.check_writable()
        cal = calibrate(rec, hardware)
        if save:
            cal_id = st.add_calibration(rec.id, cal.hardware_name, cal.params_dict(), cal.to_dict(),
                                        cal.created_at)
    if as_json:
        print_json(cal.to_dict())
        return
    console.print(report_table(cal))
    console.print(f"before: {cal.before}\nafter:  {cal.after}")
    console.print(f"typical error exp(rms log(predicted/measured)) - 1: {cal.error_before:.1%} before, "
                  f"{cal.error_after:.1%} after")
    if save:
        err_console.print(f"stored as calibration {cal_id} of profile {rec.id}")
