"""`lynx solve`: Lynx-HEU for one stage of a user's own layer graph (what `lynx graph --json` writes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from lynx.cli.app import app
from lynx.cli.common import BUDGET_GB, JsonOpt, check_floats, check_ints, console, print_json
from lynx.cost.memory import stage_peak_bytes
from lynx.decisions import StageContext
from lynx.errors import PlanFormatError, SpecError
from lynx.families.gpt import MODULE_OF
from lynx.graph import LayerGraph
from lynx.milp import Backend
from lynx.paths import MAX_JSON_BYTES, read_text
from lynx.schedule import facts_1f1b
from lynx.spec import MAX_LAYERS, MAX_MICROBATCHES, MAX_STAGES, GiB
from lynx.validate import POSITIVE, Range


def _policy_table(graph: LayerGraph, ops: dict[str, str], title: str) -> Table:
    t = Table(title=title, title_justify="left")
    for col in ("op", "kind", "decision", "recompute (ms)", "keep MiB"):
        t.add_column(col, justify="left" if col in ("op", "kind", "decision") else "right")
    for o in graph.ops:
        d = ops[o.name]
        t.add_row(o.name, o.kind, d, f"{o.fwd_time * 1e3:.3f}" if d.startswith("recompute") else "",
                  f"{graph.keep_bytes(o.name) / 2**20:.1f}" if d == "keep" else "")
    return t


@app.command("solve")
def solve_cmd(
    graph_file: Annotated[Path, typer.Option("--graph", help="Layer graph JSON (`lynx graph --json` / --out).")],
    layers: Annotated[int, typer.Option("--layers", help="Layers on the stage.")],
    in_flight: Annotated[int, typer.Option("--in-flight", help="Micro-batches in flight at the peak "
                                                "(1F1B: stages from this one to the last).")],
    budget_gb: Annotated[float, typer.Option("--budget-gb", help="Memory for the stage's activations and "
                                             "static state, GiB.")],
    static_gb: Annotated[float, typer.Option("--static-gb", help="Parameters, gradients, optimizer, GiB.")] = 0.0,
    last_stage: Annotated[bool, typer.Option("--last-stage", help="Last stage or PP = 1: no forward windows "
                                             "(phases 3, 4, 5 only).")] = False,
    microbatches: Annotated[int, typer.Option("--microbatches", help="Micro-batches per iteration.")] = 64,
    no_wgrad_overlap: Annotated[bool, typer.Option(
        "--no-wgrad-overlap", help="Backward windows offer the whole collective.")] = False,
    no_cooldown_overlap: Annotated[bool, typer.Option(
        "--no-cooldown-overlap", help="Do not hide cool-down recomputation in stalls.")] = False,
    mixed: Annotated[bool, typer.Option("--mixed", help="Allow two layer policies (k layers each).")] = False,
    backend: Annotated[str, typer.Option(help="MILP backend: highs (default) or gurobi (if installed).")] = "highs",
    time_limit: Annotated[float, typer.Option(help="Time limit per ILP solve, seconds.")] = 10.0,
    as_json: JsonOpt = False,
) -> None:
    """Solve Lynx-HEU for one pipeline stage of your own layer graph and print the policy, its objective,
    solve time and model size."""
    from lynx.policy.heu import HeuOptions, critical_recompute, heu_policy
    from lynx.policy.heu_mixed import mixed_policy

    check_ints(**{"--layers": (layers, Range(gt=0, le=MAX_LAYERS)),
                  "--in-flight": (in_flight, Range(gt=0, le=MAX_STAGES)),
                  "--microbatches": (microbatches, Range(gt=0, le=MAX_MICROBATCHES))})
    check_floats(**{"--budget-gb": (budget_gb, BUDGET_GB), "--static-gb": (static_gb, Range(ge=0, le=1e6)),
                    "--time-limit": (time_limit, POSITIVE)})
    if static_gb >= budget_gb:
        raise SpecError(f"--static-gb {static_gb:g} must be below --budget-gb {budget_gb:g}")
    text = read_text(graph_file, "graph", MAX_JSON_BYTES, PlanFormatError)
    try:
        graph = LayerGraph.from_json(text, MODULE_OF)
    except PlanFormatError as e:
        raise PlanFormatError(f"{graph_file}: {e}") from None
    # A stage context that reproduces the flags, with the schedule's facts of a 1F1B pipeline `in_flight`
    # stages deep: its first stage (`in_flight` micro-batches in flight), or its last with --last-stage.
    depth, m = max(in_flight, 2) if not last_stage else in_flight, max(microbatches, in_flight)
    facts = facts_1f1b(depth, m).of(depth - 1 if last_stage else 0)
    ctx = StageContext(stage=facts.rank, num_stages=depth, num_layers=layers, in_flight=in_flight,
                       num_microbatches=m, budget_bytes=budget_gb * GiB,
                       static_bytes=static_gb * GiB, subtract_wgrad=not no_wgrad_overlap,
                       fwd_windows=facts.has_fwd_windows and in_flight > 1,
                       cooldown_microbatches=facts.cooldown_count)
    if ctx.has_fwd_windows == last_stage and in_flight > 1:
        raise SpecError("internal: stage context does not match --last-stage")  # pragma: no cover
    backends: dict[str, Backend] = {"highs": "highs", "gurobi": "gurobi"}
    if backend not in backends:
        raise SpecError(f"--backend {backend!r}: expected highs or gurobi")
    if backend == "gurobi" and importlib.util.find_spec("gurobipy") is None:
        raise SpecError("--backend gurobi needs gurobipy, which is not installed (HiGHS is the default)")
    # Always solve the ILP here: the user asked for its objective, solve time and size.
    opts = HeuOptions(cooldown_overlap=not no_cooldown_overlap, backend=backends[backend], time_limit_s=time_limit,
                      skip_when_all_fit=False)
    pol = (mixed_policy if mixed else heu_policy)(ctx, graph, opts)
    st = pol.stats
    peak = stage_peak_bytes(graph, pol.layers, ctx)
    crit = critical_recompute(graph, pol.layers, ctx, opts.cooldown_overlap)
    d = pol.to_dict(graph)
    summary = {"objective_s": st.objective, "critical_recompute_s_per_microbatch": crit,
               "solve_time_s": st.solve_time_s, "num_variables": st.num_variables,
               "num_constraints": st.num_constraints, "status": st.status, "solver": st.solver,
               "peak_bytes": peak, "budget_bytes": ctx.budget_bytes, "forward_windows": ctx.has_fwd_windows}
    if as_json:
        print_json({**summary, "policy": d})
        return
    console.print(f"[bold]{graph_file}[/bold]: {layers} layers, {in_flight} in flight, budget {budget_gb:g} GiB"
                  f"{', last stage' if last_stage else ''}")
    how = (f"{st.status} in {st.solve_time_s * 1e3:.1f} ms, model {st.num_variables} variables x "
           f"{st.num_constraints} constraints ({st.solver})" if st.solver != "closed-form" else
           "no ILP needed: keeping every activation fits")
    console.print(f"objective {st.objective * 1e3:.4f} ms (critical recompute {crit * 1e3:.4f} ms per "
                  f"micro-batch), {how}; peak {peak / GiB:.2f} GiB")
    groups = d["layers"]
    for i, grp in enumerate(groups):
        title = ("policy of one layer, applied to every layer of the stage" if len(groups) == 1 else
                 f"layers {sum(g['count'] for g in groups[:i])}-{sum(g['count'] for g in groups[:i + 1]) - 1}"
                 " (bottom first)")
        console.print(_policy_table(graph, grp["ops"], title))
