"""`lynx plan`, `lynx simulate`, `lynx graph`, `lynx presets`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from lynx.cli.app import app
from lynx.cli.common import (
    JSON_FORMATS,
    PLOT_FORMATS,
    BusbwOpt,
    BytesPerParamOpt,
    CpCommTypeOpt,
    CpOpt,
    EtpOpt,
    GbOpt,
    HardwareOpt,
    HierCpOpt,
    JsonOpt,
    MbOpt,
    ModelOpt,
    NodesOpt,
    SeqOpt,
    SpOpt,
    TpOpt,
    build_problem,
    check_ints,
    check_outputs,
    console,
    err_console,
    parallel_spec,
    parse_hierarchical_cp,
    print_json,
)
from lynx.errors import SpecError
from lynx.models import total_params
from lynx.paths import atomic_path, write_text
from lynx.spec import GiB
from lynx.validate import POSITIVE

EXIT_NONE_FITS = 3
"""`lynx plan --compare`: no method gives a plan that fits the budget (documented in README)."""

if TYPE_CHECKING:
    from lynx.plan import Plan
    from lynx.problem import PlanProblem, PlanResult
    from lynx.schedule import Schedule


def with_megatron_split(problem: PlanProblem, first: int | None, last: int | None, emb: bool,
                        loss: bool) -> PlanProblem:
    """Megatron's pipeline-balancing flags: the partition of the stock Megatron rows only
    (`methods.common.megatron_partition` reads them as Megatron-Core does)."""
    if first is None and last is None and not emb and not loss:
        return problem
    from dataclasses import replace

    from lynx.checks import check_inputs

    opts = replace(problem.options, decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last,
                   account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss)
    check_inputs(problem.model, problem.hardware, problem.parallel, opts)
    return replace(problem, options=opts)


_FUSION_PANEL = "Megatron-Core fusions (docs/costmodel.md)"


def _fusions_given(flags: dict[str, Any]) -> list[str]:
    """The fusion flags that differ from Megatron-Core's defaults, by name."""
    return [f"{f} {v}" if f == "--transformer-impl" else f for f, v in flags.items()
            if (v != "transformer_engine" if f == "--transformer-impl" else v)]


def with_fusions(problem: PlanProblem, flags: dict[str, Any]) -> PlanProblem:
    """The problem with the model's fusion fields set from Megatron's flags (`--transformer-impl local` plans
    Megatron-Core's local attention, which is unfused), its graph rebuilt and its inputs checked again."""
    from dataclasses import replace

    from lynx.api import make_problem
    from lynx.export.megatron_fusion import fusion_fields

    fields = fusion_fields(flags, problem.model.activation)
    if fields["transformer_impl"] == "local":
        fields["attention"] = "standard"
    return make_problem(replace(problem.model, **fields), problem.hardware, problem.parallel, problem.options)


def with_vpp(problem: PlanProblem, vpp: int) -> PlanProblem:
    """The problem planned with `vpp` model chunks per rank (validated like every other layout option)."""
    from dataclasses import replace

    from lynx.api import make_problem

    return make_problem(problem.model, problem.hardware, problem.parallel, replace(problem.options, vpp=vpp),
                        None if problem.heterogeneous else problem.graph)


def check_schedule_fits(sched: Schedule, problem: PlanProblem, result: PlanResult) -> None:
    par, part = problem.parallel, result.partition
    if sched.pp != par.pp or sched.num_chunks != part.num_chunks or sched.num_microbatches != par.num_microbatches:
        raise SpecError(f"--schedule: {sched.pp} ranks x {sched.num_chunks} chunks x {sched.num_microbatches} "
                        f"micro-batches; the plan has {par.pp} x {part.num_chunks} x {par.num_microbatches}")


def _load_profile_graph(profile: str, db: Path | None) -> Any:
    try:
        from lynx.profile.store import load_profile_graph  # type: ignore[import-not-found,unused-ignore]
    except ModuleNotFoundError:
        raise SpecError("--profile needs the profiler (lynx.profile), which is not installed") from None
    return load_profile_graph(profile, db)


def _emit_plots(plan: Any, gantt: Path | None, memory_png: Path | None) -> None:
    if gantt is None and memory_png is None:
        return
    from lynx.report.plots import gantt as draw_gantt
    from lynx.report.plots import memory_plot

    if gantt is not None:
        with atomic_path(gantt, "--gantt") as tmp:
            draw_gantt(plan, tmp)
        err_console.print(f"wrote {gantt}")
    if memory_png is not None:
        with atomic_path(memory_png, "--memory-png") as tmp:
            memory_plot(plan, tmp)
        err_console.print(f"wrote {memory_png}")


def _compare(problem: PlanProblem, method: str, title: str, as_json: bool, plots: bool) -> tuple[Plan | None, bool]:
    """Every method side by side; returns `method`'s plan (with its timeline when plots are wanted) and
    whether no method fits the budget."""
    from lynx.api import compare as compare_methods
    from lynx.plan import Plan
    from lynx.report.tables import compare_table

    with err_console.status("planning...") as status:
        rows = compare_methods(problem, progress=lambda n: status.update(f"planning with {n}..."))
    chosen = next((r.plan for r in rows if r.method == method and r.plan is not None), None)
    if as_json:
        interleaved = problem.options.vpp > 1
        print_json({"title": title, "methods": [
            {"method": r.method, "error": r.error, **(r.plan.prediction.to_dict() if r.plan else {}),
             "partition": list(r.plan.result.partition.layers_per_stage) if r.plan else None,
             **({"chunks": list(r.plan.result.partition.chunks)} if r.plan and interleaved else {})}
            for r in rows]})
    else:
        console.print(compare_table(rows, title))
    none_fits = not any(r.plan is not None and not r.plan.sim.oom for r in rows)
    if none_fits:
        err_console.print(f"lynx: no method fits the memory budget ({problem.budget_bytes / GiB:.2f} GiB per "
                          f"device); exit code {EXIT_NONE_FITS}", soft_wrap=True)
    if chosen is None:
        err_console.print(f"lynx: method {method} gave no plan; no file written", soft_wrap=True)
    elif plots:
        chosen = Plan.evaluate(chosen.problem, chosen.result)  # with the timeline the plots need
    return chosen, none_fits


def _single(problem: PlanProblem, method: str, title: str, as_json: bool) -> Plan:
    from lynx.api import plan as plan_one
    from lynx.report.tables import policy_table, stage_table

    plan = plan_one(problem, method)
    if as_json:
        print_json(plan.to_dict() | {"graph": "(omitted; see --out)"})
        return plan
    console.print(f"[bold]{title}[/bold]")
    console.print(f"method [bold]{plan.result.method}[/bold], partition {plan.result.partition} "
                  f"({plan.result.partition.method}), search {plan.result.search_time_s:.2f} s")
    for note in plan.result.notes:
        console.print(f"  note: {note}")
    s = plan.sim
    console.print(f"iteration {s.iteration_time_s:.3f} s, {s.samples_per_s:.2f} samples/s, "
                  f"{s.model_tflops_per_gpu:.1f} model TFLOP/s per GPU (MFU {s.mfu:.1%}), "
                  f"bubble {s.bubble_fraction:.1%}" + ("  [red]OOM[/red]" if s.oom else ""))
    console.print(stage_table(plan))
    console.print(policy_table(plan))
    return plan


def _check_plan_outputs(out: Path | None, gantt: Path | None, memory_png: Path | None) -> None:
    check_outputs(**{"--out": (out, JSON_FORMATS), "--gantt": (gantt, PLOT_FORMATS),
                     "--memory-png": (memory_png, PLOT_FORMATS)})


def _given(value: int | None, default: int) -> int:
    """The option's value, or the single layout's default when it was not given (0 stays 0: it is refused
    by the option checks with its name)."""
    return default if value is None else value


def _search(model: str, hardware: str, gpus: int | None, nodes: int | None, tp: int | None, pp: int | None,
            dp: int | None, vpp: int | None, sp: bool | None, mb: int | None, dist_opt: bool | None,
            method: str | None, global_batch: int, seq_len: int, compare: bool, gantt: Path | None,
            memory_png: Path | None, profile: str | None, cross_node: bool, allow_idle: bool, top: int,
            as_json: bool, out: Path | None, png: Path | None, knobs: dict[str, Any]) -> None:
    """`lynx plan --gpus N` (or --nodes K without a full layout): the configuration search."""
    from lynx.cli.search import SearchArgs, cluster_gpus, derive_dp, run_search
    from lynx.models import load_model
    from lynx.spec import load_hardware

    for flag, given in (("--compare", compare), ("--gantt", gantt), ("--memory-png", memory_png),
                        ("--profile", profile)):
        if given:
            raise SpecError(f"{flag} plans one layout; with --gpus / --nodes lynx searches layouts (drop {flag}, "
                            "or give --tp, --pp and --dp without --gpus)")
    check_ints(**{"--tp": (tp, POSITIVE), "--pp": (pp, POSITIVE), "--dp": (dp, POSITIVE),
                  "--micro-batch": (mb, POSITIVE), "--global-batch": (global_batch, POSITIVE),
                  "--seq-len": (seq_len, POSITIVE), "--nodes": (nodes, POSITIVE)})
    hw = load_hardware(hardware)
    total = cluster_gpus(hw, gpus, nodes)
    assert total is not None
    where = f"--gpus {gpus}" if gpus is not None else f"--nodes {nodes} x {hw.devices_per_node} per node"
    cp = knobs.pop("cp")
    cp_comm_type = knobs.pop("cp_comm_type")
    offload = knobs.pop("offload")
    ep, etp = knobs.pop("ep"), knobs.pop("etp")
    check_ints(**{"--cp": (cp, POSITIVE)})
    if tp is not None and pp is not None:  # the layout is pinned: CP too (1 unless --cp), DP derived
        cp = cp or 1
        dp = derive_dp(tp, pp, dp, total, where, allow_idle, cp)
        total = tp * cp * pp * dp
    elif dp is not None:
        raise SpecError("--dp with --gpus: DP follows from GPUs / (TP x PP); pin --tp and --pp instead")
    if knobs["overlap_param_gather"]:  # Megatron's rule: it gathers the distributed optimizer's shards
        if dist_opt is False:
            raise SpecError("--overlap-param-gather needs --distributed-optimizer")
        dist_opt = True
    if knobs["tp_comm_overlap"]:  # TransformerEngine's userbuffers overlap the SP collectives
        if sp is False:
            raise SpecError("--tp-comm-overlap needs sequence parallelism (--sp)")
        sp = True
    # the shared knobs' problem: MoE with a pinned TP > 1 needs SP (Megatron's rule); the search decides SP itself
    sp_base = bool(sp) if sp is not None else (tp or 1) > 1 and load_model(model).is_moe
    problem = build_problem(model, hardware, tp or 1, pp or 1, 1, sp_base, 1, global_batch, seq_len, None, None,
                            knobs["budget_gb"], knobs["bytes_per_param"], knobs["recompute_num_layers"],
                            knobs["no_wgrad_overlap"], None, knobs["time_limit"],
                            cooldown_overlap=knobs["cooldown_overlap"], precision=knobs["precision"] or "paper",
                            distributed_optimizer=bool(dist_opt), busbw_gbps=None,
                            overlap_grad_reduce=knobs["overlap_grad_reduce"],
                            overlap_param_gather=knobs["overlap_param_gather"],
                            tp_comm_overlap=knobs["tp_comm_overlap"])  # the shared knobs; the layout is searched
    if knobs["busbw"] is not None:
        raise SpecError("--busbw is a TP group's measured bandwidth; pin --tp to use it (not with the search)")
    run_search(SearchArgs(model, hardware, total, global_batch, seq_len, tp, pp, vpp, sp, mb, dist_opt, method,
                          cross_node, top, as_json, out, png, cp, cp_comm_type, offload, ep, etp), problem.options)


@app.command("plan")
def plan_cmd(
    model: ModelOpt = "gpt-7b",
    hardware: HardwareOpt = "a100-40g-nvlink",
    tp: Annotated[int | None, typer.Option("--tp", "--tensor-model-parallel-size",
                                           help="Tensor-parallel size [default: 4; searched with --gpus].")] = None,
    pp: Annotated[int | None, typer.Option("--pp", "--pipeline-model-parallel-size",
                                           help="Pipeline-parallel size [default: 4; searched with --gpus].")] = None,
    dp: Annotated[int | None, typer.Option("--dp", help="Data-parallel size [default: 1, or GPUs / (TP x PP) "
                                           "with --gpus / --nodes].")] = None,
    cp: Annotated[int | None, typer.Option(
        "--cp", "--context-parallel-size", help="Context-parallel size: each rank holds seq / CP tokens; attention "
        "as Megatron-Core's ring attention (world size TP x CP x PP x DP; gradients reduced over DP x CP) "
        "[default: 1; searched with --gpus for long sequences].")] = None,
    cp_comm_type: CpCommTypeOpt = "p2p",
    hierarchical_cp: HierCpOpt = None,
    ep: Annotated[int | None, typer.Option(
        "--ep", "--expert-model-parallel-size", help="Expert-parallel size (MoE models): experts split over EP "
        "ranks of each stage's TP x CP x DP ranks, as Megatron-Core folds it [default: 1; searched with --gpus]."
    )] = None,
    etp: EtpOpt = None,
    sp: Annotated[bool | None, typer.Option("--sp/--no-sp", "--sequence-parallel",
                                            help="Megatron sequence parallelism [default: off; searched with "
                                            "--gpus].")] = None,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch", "--micro-batch-size",
                                                    help="Micro-batch size per GPU [default: 8; searched with "
                                                    "--gpus].")] = None,
    global_batch: GbOpt = 128,
    seq_len: SeqOpt = 1024,
    nodes: NodesOpt = None,
    method: Annotated[str | None, typer.Option(help="Planning method: lynx (default when available), none, full, "
                                               "selective, uniform, block, ... (see `lynx methods`); with --gpus "
                                               "the one method searched.")] = None,
    compare: Annotated[bool, typer.Option("--compare", help="Evaluate every method side by side.")] = False,
    vpp: Annotated[int | None, typer.Option("--vpp", "--virtual-pipeline-model-parallel-size",
                                            help="Model chunks per pipeline rank: 1 = 1F1B, more = Megatron's "
                                            "interleaved 1F1B (needs a multiple of --pp micro-batches) "
                                            "[default: 1; searched with --gpus].")] = None,
    gpus: Annotated[int | None, typer.Option("--gpus", help="Search the whole configuration (TP, PP, VPP, DP, SP, "
                                             "micro-batch, optimizer sharding, method) for this many GPUs; "
                                             "options given pin their dimension (docs/choosing-a-configuration.md)."
                                             )] = None,
    allow_cross_node_tp: Annotated[bool, typer.Option(
        "--allow-cross-node-tp", help="With --gpus: also try TP groups larger than one node.")] = False,
    allow_idle_gpus: Annotated[bool, typer.Option(
        "--allow-idle-gpus", help="Accept a layout that leaves some of --gpus / --nodes idle.")] = False,
    top: Annotated[int, typer.Option("--top", help="With --gpus: configurations in the table.")] = 5,
    search_png: Annotated[Path | None, typer.Option(
        "--search-png", help="With --gpus: plot every candidate's time against its peak memory (PNG).")] = None,
    layers_per_stage: Annotated[str | None, typer.Option(help="Explicit partition, e.g. 7,8,8,9.")] = None,
    budget_gb: Annotated[
        float | None, typer.Option(help="Usable memory per GPU in GiB (default: capacity minus reserve).")
    ] = None,
    bytes_per_param: BytesPerParamOpt = None,
    precision: Annotated[str | None, typer.Option(
        "--precision", help="Static-memory recipe: paper (16 B/param, the default), megatron-bf16 (18), "
        "megatron-fp16 (20), fp32 (16). With --from-megatron: the command line's --bf16 / --fp16 unless given.")
    ] = None,
    distributed_optimizer: Annotated[bool | None, typer.Option(
        "--distributed-optimizer/--no-distributed-optimizer", "--use-distributed-optimizer",
        help="Shard fp32 main weights and optimizer state over DP (Megatron's distributed optimizer) "
        "[default: off; searched with --gpus].")] = None,
    busbw: BusbwOpt = None,
    recompute_num_layers: Annotated[
        int | None, typer.Option(help="Megatron --recompute-num-layers for uniform/block (default: auto).")
    ] = None,
    no_wgrad_overlap: Annotated[
        bool, typer.Option("--no-wgrad-overlap",
                           help="Backward windows offer the whole collective (no Megatron wgrad overlap).")
    ] = False,
    no_cooldown_overlap: Annotated[
        bool, typer.Option("--no-cooldown-overlap",
                           help="Do not hide recomputation in cool-down pipeline stalls (paper sec. 4.2).")
    ] = False,
    profile: Annotated[
        str | None, typer.Option(help="Plan from a stored profile ID instead of the analytic model.")
    ] = None,
    db: Annotated[Path | None, typer.Option(help="Profile database (with --profile).")] = None,
    time_limit: Annotated[float, typer.Option(help="Time limit per MILP solve, seconds.")] = 30.0,
    as_json: JsonOpt = False,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the plan file (JSON).")] = None,
    gantt: Annotated[Path | None, typer.Option(help="Write the pipeline Gantt chart (PNG).")] = None,
    memory_png: Annotated[
        Path | None, typer.Option("--memory-png", help="Write memory per stage over time (PNG).")
    ] = None,
    overlap_grad_reduce: Annotated[bool, typer.Option(
        "--overlap-grad-reduce", help="Megatron's --overlap-grad-reduce: the DP gradient reduction runs in buckets "
        "during the last micro-batch's backward (docs/costmodel.md).")] = False,
    overlap_param_gather: Annotated[bool, typer.Option(
        "--overlap-param-gather", help="Megatron's --overlap-param-gather (needs --distributed-optimizer): the "
        "parameter all-gather runs during the next iteration's first forward.")] = False,
    tp_comm_overlap: Annotated[bool, typer.Option(
        "--tp-comm-overlap", help="Megatron's --tp-comm-overlap (TransformerEngine userbuffers, needs --sp): SP "
        "collectives pipelined with their GEMMs; Lynx's windows shrink to what is left.")] = False,
    from_megatron: Annotated[str | None, typer.Option(
        "--from-megatron", help="Simulate a Megatron-LM command line (quoted) next to lynx's plan; sizes come "
        "from it, --hardware/--dp/--nodes/--budget-gb from lynx's options (docs/export.md).")] = None,
    decoder_first_pipeline_num_layers: Annotated[int | None, typer.Option(
        "--decoder-first-pipeline-num-layers", help="Megatron's flag: the stock Megatron rows run with this many "
        "layers on the first stage, the rest even (lynx's methods partition on their own).")] = None,
    decoder_last_pipeline_num_layers: Annotated[int | None, typer.Option(
        "--decoder-last-pipeline-num-layers", help="Megatron's flag, for the stock Megatron rows: layers on the "
        "last stage.")] = None,
    account_for_embedding_in_pipeline_split: Annotated[bool, typer.Option(
        "--account-for-embedding-in-pipeline-split", help="Megatron's flag, for the stock Megatron rows: the "
        "embedding counts as a layer of the even split.")] = False,
    account_for_loss_in_pipeline_split: Annotated[bool, typer.Option(
        "--account-for-loss-in-pipeline-split", help="Megatron's flag, for the stock Megatron rows: the loss "
        "counts as a layer of the even split.")] = False,
    transformer_impl: Annotated[str, typer.Option(
        "--transformer-impl", help="transformer_engine (Megatron-Core's default) or local: Megatron-Core's own "
        "modules, whose core attention is unfused (planned as standard attention).",
        rich_help_panel=_FUSION_PANEL)] = "transformer_engine",
    no_bias_swiglu_fusion: Annotated[bool, typer.Option(
        "--no-bias-swiglu-fusion", help="SwiGLU as eager silu and product (more HBM passes; saves silu(gate)).",
        rich_help_panel=_FUSION_PANEL)] = False,
    no_bias_gelu_fusion: Annotated[bool, typer.Option(
        "--no-bias-gelu-fusion", help="GeLU after FC1's bias as two eager kernels.",
        rich_help_panel=_FUSION_PANEL)] = False,
    no_masked_softmax_fusion: Annotated[bool, typer.Option(
        "--no-masked-softmax-fusion", help="Standard attention's mask and softmax as two eager kernels.",
        rich_help_panel=_FUSION_PANEL)] = False,
    no_bias_dropout_fusion: Annotated[bool, typer.Option(
        "--no-bias-dropout-fusion", help="The residuals' bias add, dropout and add as separate kernels.",
        rich_help_panel=_FUSION_PANEL)] = False,
    no_rope_fusion: Annotated[bool, typer.Option(
        "--no-rope-fusion", help="RoPE as Megatron's eager rotate-half.", rich_help_panel=_FUSION_PANEL)] = False,
    no_gradient_accumulation_fusion: Annotated[bool, typer.Option(
        "--no-gradient-accumulation-fusion", help="A separate pass adds each weight gradient into the fp32 main "
        "gradient every micro-batch.", rich_help_panel=_FUSION_PANEL)] = False,
    cross_entropy_loss_fusion: Annotated[bool, typer.Option(
        "--cross-entropy-loss-fusion", help="Megatron-Core's fused vocab-parallel cross entropy (off by default, "
        "as in Megatron).", rich_help_panel=_FUSION_PANEL)] = False,
    offload: Annotated[bool | None, typer.Option(
        "--offload/--no-offload", help="With --gpus: also plan every layout with activation offloading (lynx-offload "
        "and Megatron's mc-offload) [default: on when the hardware has a host link].")] = None,
) -> None:
    """Plan recomputation and partitioning for a model on a cluster, and predict its iteration.

    With --compare the exit code is 3 when no method fits the memory budget (the table says so)."""
    from lynx.methods import available_methods

    fusion_flags = {"--transformer-impl": transformer_impl, "--no-bias-swiglu-fusion": no_bias_swiglu_fusion,
                    "--no-bias-gelu-fusion": no_bias_gelu_fusion,
                    "--no-masked-softmax-fusion": no_masked_softmax_fusion,
                    "--no-bias-dropout-fusion": no_bias_dropout_fusion, "--no-rope-fusion": no_rope_fusion,
                    "--no-gradient-accumulation-fusion": no_gradient_accumulation_fusion,
                    "--cross-entropy-loss-fusion": cross_entropy_loss_fusion}
    fusions_given = _fusions_given(fusion_flags)
    if fusions_given and (gpus is not None or (nodes is not None and (tp is None or pp is None))):
        raise SpecError(f"{fusions_given[0]}: the configuration search (--gpus / --nodes) plans Megatron-Core's "
                        "defaults (TransformerEngine, fusions on); pin --tp and --pp to plan this flag")
    if fusions_given and from_megatron is not None:
        raise SpecError(f"{fusions_given[0]}: with --from-megatron give it inside the Megatron command line")
    if fusions_given and profile:
        raise SpecError(f"{fusions_given[0]} with --profile: a profile measured the kernels it ran; the fusion flags "
                        "change the analytic model only")
    _check_plan_outputs(out, gantt, memory_png)
    check_outputs(**{"--search-png": (search_png, PLOT_FORMATS)})
    check_ints(**{"--gpus": (gpus, POSITIVE), "--top": (top, POSITIVE), "--vpp": (vpp, POSITIVE)})
    if gpus is not None or (nodes is not None and (tp is None or pp is None) and from_megatron is None):
        if cp_comm_type == "a2a+p2p":
            raise SpecError("--cp-comm-type a2a+p2p with --gpus / --nodes: its hierarchical sizes depend on the "
                            "CP size; search with p2p, a2a or all_gather, or give the layout with --tp --pp --cp")
        return _search(model, hardware, gpus, nodes, tp, pp, dp, vpp, sp, micro_batch, distributed_optimizer,
                       method, global_batch, seq_len, compare, gantt, memory_png, profile, allow_cross_node_tp,
                       allow_idle_gpus, top, as_json, out, search_png,
                       dict(budget_gb=budget_gb, bytes_per_param=bytes_per_param, precision=precision,
                            recompute_num_layers=recompute_num_layers, no_wgrad_overlap=no_wgrad_overlap,
                            time_limit=time_limit, cooldown_overlap=not no_cooldown_overlap, busbw=busbw,
                            overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
                            tp_comm_overlap=tp_comm_overlap, cp=cp, cp_comm_type=cp_comm_type, offload=offload,
                            ep=ep, etp=etp))
    if offload is not None:
        raise SpecError("--offload/--no-offload chooses the search's methods (with --gpus); for one layout use "
                        "--method lynx-offload or --compare")
    cp = _given(cp, 1)
    if nodes is not None and dp is None and tp is not None and pp is not None:
        from lynx.cli.search import derive_dp
        from lynx.spec import load_hardware

        per_node = load_hardware(hardware).devices_per_node
        if tp * cp * pp <= nodes * per_node:  # else the layout check says how many nodes it needs
            dp = derive_dp(tp, pp, None, nodes * per_node, f"--nodes {nodes} x {per_node} per node",
                           allow_idle_gpus, cp)  # TP x CP ranks per pipeline stage
    if from_megatron is not None:  # the import path lives in lynx.cli.export
        from lynx.cli.export import LynxFlags, plan_from_megatron

        given = LynxFlags(precision, bool(distributed_optimizer), overlap_grad_reduce, overlap_param_gather,
                          tp_comm_overlap)
        return plan_from_megatron(from_megatron, hardware, _given(dp, 1), nodes, budget_gb, bytes_per_param,
                                  as_json, out, given)
    tp, pp, dp = _given(tp, 4), _given(pp, 4), _given(dp, 1)  # the single layout's defaults
    sp, micro_batch, vpp = bool(sp), _given(micro_batch, 8), _given(vpp, 1)
    method, distributed_optimizer = method or "lynx", bool(distributed_optimizer)
    graph = _load_profile_graph(profile, db) if profile else None
    problem = build_problem(model, hardware, tp, pp, dp, sp, micro_batch, global_batch, seq_len, nodes,
                            layers_per_stage, budget_gb, bytes_per_param, recompute_num_layers,
                            no_wgrad_overlap, graph, time_limit, cooldown_overlap=not no_cooldown_overlap,
                            precision=precision or "paper", distributed_optimizer=distributed_optimizer,
                            busbw_gbps=busbw,
                            overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
                            tp_comm_overlap=tp_comm_overlap, cp=cp, cp_comm_type=cp_comm_type,
                            hierarchical_cp=hierarchical_cp, ep=_given(ep, 1), etp=etp)
    if fusions_given:
        problem = with_fusions(problem, fusion_flags)
    from lynx.cli.export import budget_warnings

    for w in budget_warnings(budget_gb, problem.hardware):  # after the checks: a NaN has been refused
        err_console.print(f"[yellow]warning:[/yellow] {w}", highlight=False)
    if vpp != 1:
        problem = with_vpp(problem, vpp)
    problem = with_megatron_split(problem, decoder_first_pipeline_num_layers, decoder_last_pipeline_num_layers,
                                  account_for_embedding_in_pipeline_split, account_for_loss_in_pipeline_split)
    if graph is not None and graph.meta.device and graph.meta.device != problem.hardware.device.name:
        err_console.print(
            f"[yellow]warning:[/yellow] profile {profile} was measured on {graph.meta.device!r} "
            f"({graph.meta.dtype}); planning for {problem.hardware.device.name} memory with its times and sizes"
        )
    none_fits = False
    if method == "lynx" and "lynx" not in available_methods():
        method = "full"
    vpp_text = f" VPP {vpp}" if vpp > 1 else ""
    kind = problem.parallel.cp_comm_type
    cp_text = f" CP {cp}" + (f" ({kind})" if kind != "p2p" else "") if cp > 1 else ""
    par_ = problem.parallel
    cp_text += f" EP {par_.ep}" + (f" ETP {par_.expert_tp}" if par_.expert_tp != tp else "") if par_.ep > 1 else ""
    title = (f"{problem.model.name} on {problem.hardware.name}: TP {tp}{cp_text} PP {pp}{vpp_text} DP {dp}"
             f"{' SP' if sp else ''}, micro-batch {micro_batch}, global batch {global_batch}, seq {seq_len}, "
             f"{problem.parallel.num_microbatches} micro-batches" + (f"; {' '.join(fusions_given)}" if fusions_given
                                                                      else ""))
    if compare:
        plan, none_fits = _compare(problem, method, title, as_json, gantt is not None or memory_png is not None)
    else:
        plan = _single(problem, method, title, as_json)
    if plan is not None:
        if out is not None:
            plan.save(out)
            err_console.print(f"wrote {out}")
        _emit_plots(plan, gantt, memory_png)
    if none_fits:
        raise typer.Exit(EXIT_NONE_FITS)


@app.command("simulate")
def simulate_cmd(
    plan_file: Annotated[Path, typer.Argument(help="A plan written by `lynx plan --out`.")],
    as_json: JsonOpt = False,
    gantt: Annotated[Path | None, typer.Option(help="Write the pipeline Gantt chart (PNG).")] = None,
    memory_png: Annotated[Path | None, typer.Option("--memory-png", help="Write memory per stage (PNG).")] = None,
    schedule: Annotated[Path | None, typer.Option(
        "--schedule", help="Run this action list instead of the plan's own (CSV, torch.distributed.pipelining's "
        "compute-only format: one row per rank, e.g. 0F0,0F1,0B0,...).")] = None,
) -> None:
    """Re-evaluate a saved plan with the event simulator (under its own schedule or a user's)."""
    from lynx.plan import Plan, load_plan
    from lynx.report.tables import stage_table
    from lynx.schedule import load_csv

    _check_plan_outputs(None, gantt, memory_png)
    problem, result = load_plan(plan_file)
    sched = load_csv(schedule) if schedule is not None else None
    if sched is not None:
        check_schedule_fits(sched, problem, result)
    plan = Plan.evaluate(problem, result, schedule=sched)
    if as_json:
        print_json(plan.prediction.to_dict())
    else:
        s = plan.sim
        console.print(f"[bold]{plan_file}[/bold]: {result.method}, partition {result.partition}: iteration "
                      f"{s.iteration_time_s:.3f} s, {s.samples_per_s:.2f} samples/s, MFU {s.mfu:.1%}"
                      + ("  [red]OOM[/red]" if s.oom else ""))
        console.print(stage_table(plan))
    _emit_plots(plan, gantt, memory_png)


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
    from lynx.models import load_model, model_presets
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
