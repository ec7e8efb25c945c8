"""`lynx graph`, `lynx methods`, `lynx presets`: what lynx knows (one layer's op graph, the planning methods,
the built-in model and hardware presets)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lynx.cli.app import app
from lynx.cli.common import (
    JSON_FORMATS,
    CpCommTypeOpt,
    CpOpt,
    HardwareOpt,
    HierCpOpt,
    JsonOpt,
    MbOpt,
    ModelOpt,
    SeqOpt,
    SpOpt,
    TpOpt,
    check_ints,
    check_outputs,
    console,
    err_console,
    parallel_spec,
    parse_hierarchical_cp,
    print_json,
)
from lynx.paths import write_text
from lynx.validate import POSITIVE


@app.command("graph")
def graph_cmd(
    model: ModelOpt = "gpt-7b",
    hardware: HardwareOpt = "a100-40g-nvlink",
    tp: TpOpt = 1,
    cp: CpOpt = 1,
    cp_comm_type: CpCommTypeOpt = "p2p",
    hierarchical_cp: HierCpOpt = None,
    sp: SpOpt = False,
    micro_batch: MbOpt = 1,
    seq_len: SeqOpt = 1024,
    as_json: JsonOpt = False,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the graph JSON to a file.")] = None,
) -> None:
    """Print the op graph of one transformer layer (the analytic cost model)."""
    from lynx.cost.layer import build_layer_graph
    from lynx.models import load_model, validate_layout
    from lynx.report.tables import graph_table
    from lynx.report.windows import windows_table
    from lynx.spec import load_hardware

    check_outputs(**{"--out": (out, JSON_FORMATS)})
    check_ints(**{"--tp": (tp, POSITIVE), "--cp": (cp, POSITIVE), "--micro-batch": (micro_batch, POSITIVE),
                  "--seq-len": (seq_len, POSITIVE)})
    m, hw = load_model(model), load_hardware(hardware)
    par = parallel_spec(tp, 1, 1, sp, micro_batch, micro_batch, seq_len, cp, cp_comm_type,
                        parse_hierarchical_cp(hierarchical_cp, cp, cp_comm_type))
    validate_layout(m, hw, par, nodes=max(1, -(-tp * cp // hw.devices_per_node)))
    g = build_layer_graph(m, hw, par)
    if out is not None:
        write_text(out, g.to_json(), "--out")
        err_console.print(f"wrote {out}")
    if as_json:
        print_json(g.to_dict())
    elif out is None:
        console.print(graph_table(g))
        console.print(windows_table(g))  # where Lynx-HEU can hide recomputation, CP's exchange included


@app.command("methods")
def methods_cmd(as_json: JsonOpt = False) -> None:
    """List the planning methods."""
    from lynx.methods import available_methods, get_method

    rows = [get_method(n) for n in available_methods()]
    if as_json:
        print_json([{"method": m.name, "description": m.description, "in_compare": m.in_compare} for m in rows])
        return
    for m in rows:
        console.print(f"[bold]{m.name:12s}[/bold] {m.description}")


@app.command("presets")
def presets_cmd(as_json: JsonOpt = False) -> None:
    """List the built-in model and hardware presets."""
    from lynx.models import load_model, model_presets, total_params
    from lynx.spec import hardware_presets, load_hardware

    models = {n: load_model(n) for n in model_presets()}
    hws = {n: load_hardware(n) for n in hardware_presets()}
    if as_json:
        print_json({"models": {n: {"family": m.family, "layers": m.num_layers, "hidden": m.hidden_size,
                                   "heads": m.num_attention_heads, "query_groups": m.num_query_groups,
                                   "params": total_params(m)} for n, m in models.items()},
                    "hardware": {n: {"device": h.device.name, "devices_per_node": h.devices_per_node,
                                     "max_nodes": h.max_nodes} for n, h in hws.items()}})
        return
    for n, m in models.items():
        gqa = f" ({m.num_query_groups} K/V)" if m.num_query_groups != m.num_attention_heads else ""
        console.print(f"model    [bold]{n:13s}[/bold] {m.family:5s} {m.num_layers} layers, hidden {m.hidden_size}, "
                      f"{m.num_attention_heads} heads{gqa}, {total_params(m) / 1e9:.2f}B parameters")
    for n, h in hws.items():
        console.print(f"hardware [bold]{n:16s}[/bold] {h.max_nodes} nodes x {h.devices_per_node} {h.device.name}")
