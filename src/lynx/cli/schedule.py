"""`lynx schedule`: print a pipeline schedule as a step x rank grid, and write or check it as CSV."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lynx.cli.app import app
from lynx.cli.common import JsonOpt, check_ints, check_outputs, console, err_console, print_json
from lynx.spec import MAX_MICROBATCHES, MAX_STAGES
from lynx.validate import Range

_KIND_STYLE = {"F": "cyan", "B": "magenta", "I": "yellow", "W": "green"}


@app.command("schedule")
def schedule_cmd(
    pp: Annotated[int, typer.Option("--pp", help="Pipeline ranks.")] = 4,
    micro_batches: Annotated[int, typer.Option("--micro-batches", "-m", help="Micro-batches per iteration.")] = 8,
    vpp: Annotated[int, typer.Option("--vpp", help="Model chunks per rank (interleaved 1F1B when > 1).")] = 1,
    kind: Annotated[str, typer.Option("--kind", help="1f1b (interleaved with --vpp > 1) or gpipe.")] = "1f1b",
    csv: Annotated[Path | None, typer.Option("--csv", help="Write the schedule as CSV (torch's compute-only "
                                             "format, loadable by _PipelineScheduleRuntime._load_csv).")] = None,
    load: Annotated[Path | None, typer.Option("--load", help="Read and validate a CSV schedule instead.")] = None,
    plan: Annotated[Path | None, typer.Option("--plan", help="The schedule a saved plan runs (its pp, "
                                              "micro-batches and vpp), e.g. to hand to the runtime as CSV.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Print the step x rank grid of a pipeline schedule (actions as torch prints them: 2F0 = global stage 2,
    forward, micro-batch 0; with --vpp, stage = chunk x pp + rank)."""
    from rich.table import Table

    from lynx.errors import SpecError
    from lynx.schedule import ScheduleError, derive_facts, load_csv, make_schedule, save_csv, schedule_gpipe, validate

    if load is not None and plan is not None:
        raise SpecError("--load and --plan name two schedules; give one")
    check_ints(**{"--pp": (pp, Range(gt=0, le=MAX_STAGES)), "--micro-batches": (micro_batches,
                  Range(gt=0, le=MAX_MICROBATCHES)), "--vpp": (vpp, Range(gt=0, le=MAX_STAGES))})
    check_outputs(**{"--csv": (csv, (".csv",))})
    if load is not None:
        try:
            sched = load_csv(load)
        except ScheduleError as e:  # show where it fails: the grid with <-- ERROR HERE
            console.print(str(e).partition("\n")[2], markup=False, highlight=False)
            raise
    elif plan is not None:
        from lynx.plan import load_plan

        sched = load_plan(plan)[0].schedule
    elif kind == "gpipe":
        if vpp != 1:
            raise SpecError("--kind gpipe has one chunk per rank; drop --vpp")
        sched = schedule_gpipe(pp, micro_batches)
    elif kind == "1f1b":
        sched = validate(make_schedule(pp, micro_batches, vpp))
    else:
        raise SpecError(f"--kind {kind!r}: expected 1f1b or gpipe")
    if csv is not None:
        save_csv(sched, csv)
        err_console.print(f"wrote {csv}")
    facts = derive_facts(sched)
    if as_json:
        print_json({"name": sched.name, "pp": sched.pp, "vpp": sched.num_chunks, "rows": sched.rows(),
                    "in_flight": [[c.in_flight for c in r] for r in facts.chunks]})
        return
    t = Table(title=f"{sched.name}: {sched.pp} ranks, {sched.num_chunks} chunk(s) per rank, "
                    f"{sched.num_microbatches} micro-batches", title_justify="left")
    t.add_column("step", justify="right")
    for r in range(sched.pp):
        peak = "/".join(str(c.in_flight) for c in facts.chunks[r])
        t.add_column(f"rank {r}\n(in flight {peak})", justify="right")
    for i in range(max(len(a) for a in sched)):
        cells = []
        for acts in sched:
            a = acts[i] if i < len(acts) else None
            cells.append("" if a is None else f"[{_KIND_STYLE[a.kind.value]}]{a.text(sched.pp)}[/]")
        t.add_row(str(i), *cells)
    console.print(t)
