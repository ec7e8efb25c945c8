"""rich tables for plans and comparisons."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.table import Table

from lynx.api import CompareRow
from lynx.decisions import RecomputePolicy
from lynx.graph import Graphs, LayerGraph
from lynx.plan import Plan

GiB = float(1 << 30)


def _gib(x: float) -> str:
    return f"{x / GiB:.1f}"


def compare_table(rows: Sequence[CompareRow], title: str) -> Table:
    base = next((r.plan for r in rows if r.method == "full" and r.plan is not None), None)
    t = Table(title=title, title_justify="left", caption_justify="left",
              caption="recompute: seconds per iteration on the critical path / hidden in collectives and stalls "
                      "(busiest stage); peak: GiB per stage, first stage first; red = over budget")
    for col, just in [("method", "left"), ("layers/stage", "left"), ("iter s", "right"), ("samples/s", "right"),
                      ("vs full", "right"), ("MFU", "right"), ("recomp crit s", "right"),
                      ("hidden s", "right"), ("peak GiB", "left"),
                      ("fits", "left")]:
        t.add_column(col, justify=just, no_wrap=col in ("peak GiB", "layers/stage"))  # type: ignore[arg-type]
    copies = any(r.plan is not None and r.plan.sim.offloads for r in rows)
    if copies:  # offload copies waited for (docs/offload.md); only when some method offloads
        t.add_column("copy s", justify="right")
        t.caption = str(t.caption) + "; copy s: offload copies waited for per iteration (busiest stage)"
    for r in rows:
        if r.plan is None:
            t.add_row(r.method, "", "", "", "", "", "", "", "", f"[red]{r.error}[/red]", *([""] if copies else []))
            continue
        s = r.plan.sim
        speed = f"{s.samples_per_s / base.sim.samples_per_s:.2f}x" if base is not None else ""
        peaks = "/".join(
            f"[red]{st.peak_memory_bytes / GiB:.1f}[/red]" if st.oom else f"{st.peak_memory_bytes / GiB:.1f}"
            for st in s.stages
        )
        t.add_row(
            r.method, str(r.plan.result.partition), f"{s.iteration_time_s:.3f}", f"{s.samples_per_s:.2f}", speed,
            f"{s.mfu:.1%}", f"{s.recompute_critical_s:.3f}", f"{s.recompute_hidden_s:.3f}", peaks,
            "[red]OOM[/red]" if s.oom else "[green]yes[/green]",
            *([f"{s.copy_exposed_s:.3f}" if s.offloads else "-"] if copies else []),
        )
    return t


def stage_table(plan: Plan) -> Table:
    t = Table(title=f"{plan.result.method}: per stage", title_justify="left")
    for col in ("stage", "layers", "F (ms)", "B (ms)", "busy (s)", "static GiB", "peak GiB", "budget GiB",
                "recompute crit (s)", "recompute hidden (s)", "OOM"):
        t.add_column(col, justify="right")
    for st in plan.sim.stages:
        t.add_row(
            str(st.stage), str(st.num_layers), f"{st.fwd_time_s * 1e3:.1f}", f"{st.bwd_time_s * 1e3:.1f}",
            f"{st.busy_time_s:.3f}", _gib(st.static_bytes), _gib(st.peak_memory_bytes), _gib(st.budget_bytes),
            f"{st.recompute_critical_s:.3f}", f"{st.recompute_overlapped_s:.3f}",
            "[red]yes[/red]" if st.oom else "no",
        )
    return t


def policy_table(plan: Plan) -> Table:
    """Per stage, the distinct layer policies: which ops are recomputed and in which phase."""
    g = plan.problem.graph
    names = list(g.names)  # several layer kinds: the primary kind's ops, then the others' own (blank where absent)
    for _, kg in plan.problem.kind_graphs:
        names += [n for n in kg.names if n not in names]
    t = Table(title=f"{plan.result.method}: policy per stage (K keep, K5 keep and re-run on demand, O offload to "
              "host, 1-5 recompute phase, . free" + (", blank: not an op of the layer's kind"
                                                    if plan.problem.heterogeneous else "") + ")",
              title_justify="left")
    t.add_column("stage/layers")
    for n in names:
        t.add_column(n, justify="center")
    ctxs = plan.problem.stage_contexts(plan.result.partition)
    for s, pol in enumerate(plan.result.policies):
        groups = _policy_groups(pol, plan.problem.graphs_for(ctxs[s]))
        first = 0
        for grp in groups:
            label = f"{s}/{first}-{first + grp['count'] - 1}"
            cells = []
            for n in names:
                v = grp["ops"].get(n, "")
                short = {"keep": "K", "keep+rerun": "K5", "offload": "O"}.get(v)
                cells.append(short or (v.split(":")[1] if v.startswith("recompute") else "." if v else ""))
            t.add_row(label, *cells)
            first += grp["count"]
    return t


def _policy_groups(pol: RecomputePolicy, graph: Graphs) -> list[dict[str, Any]]:
    """Runs of identical layers (of one kind) with each op's decision (`RecomputePolicy.to_dict`'s groups)."""
    if isinstance(graph, LayerGraph):
        return list(pol.to_dict(graph)["layers"])
    groups: list[dict[str, Any]] = []
    for g, lp in zip(graph, pol.layers, strict=True):
        d = lp.to_dict(g)
        if groups and groups[-1]["ops"] == d:
            groups[-1]["count"] += 1
        else:
            groups.append({"count": 1, "ops": d})
    return groups


def graph_table(g: LayerGraph) -> Table:
    m = g.meta
    t = Table(title=(f"layer graph ({m.source}): {m.model} h={m.hidden_size} a={m.num_attention_heads} "
                     f"s={m.seq_length} b={m.micro_batch_size} tp={m.tp}{f' cp={m.cp}' if m.cp > 1 else ''} "
                     f"sp={m.sequence_parallel} on {m.device}"),
              title_justify="left")
    for col in ("op", "kind", "block", "fwd (ms)", "bwd (ms)", "bwd exposed (ms)", "wgrad (ms)", "out MiB",
                "mask MiB", "keep MiB", "inputs", "backward reads"):
        t.add_column(col, justify="left" if col in ("op", "kind", "block", "inputs", "backward reads") else "right")
    needed = g.needed()
    for o in g.ops:
        t.add_row(
            o.name, o.kind, o.block, f"{o.fwd_time * 1e3:.3f}", f"{o.bwd_time * 1e3:.3f}",
            f"{g.exposed_bwd_time(o) * 1e3:.3f}" if o.is_comm else "-",
            f"{o.wgrad_time * 1e3:.3f}", f"{o.out_bytes / 2**20:.1f}", f"{o.mask_bytes / 2**20:.1f}",
            f"{g.keep_bytes(o.name) / 2**20:.1f}" if o.name in needed else "-",
            ",".join(o.inputs), ",".join(o.saved),
        )
    t.caption = (f"layer input {g.input_bytes / 2**20:.1f} MiB; no-recompute retained "
                 f"{g.retained_bytes(needed) / 2**20:.1f} MiB per micro-batch; forward {g.fwd_time() * 1e3:.2f} ms; "
                 f"exposed backward collectives {g.exposed_bwd_comm() * 1e3:.3f} ms")
    return t
