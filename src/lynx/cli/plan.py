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
    EtpOpt,
    GbOpt,
    HardwareOpt,
    HierCpOpt,
    JsonOpt,
    ModelOpt,
    NodesOpt,
    SeqOpt,
    check_floats,
    check_ints,
    check_outputs,
    console,
    err_console,
    print_json,
)
from lynx.cli.fp8 import (
    CompileOpt,
    Float8AllGatherOpt,
    Float8RecipeOpt,
    Fp8FormatOpt,
    Fp8ParamGatherOpt,
    Fp8RecipeOpt,
    precision_note,
)
from lynx.cli.optimizer import (
    CpuOffloadOpt,
    ExpAvgDtypeOpt,
    ExpAvgSqDtypeOpt,
    GradReduceBf16Opt,
    MainGradsDtypeOpt,
    MainParamsDtypeOpt,
    NoRemaindersOpt,
    OffloadFractionOpt,
    OverlapCpuOptimizerOpt,
    PrecisionAwareOpt,
)
from lynx.errors import SpecError
from lynx.paths import atomic_path
from lynx.spec import GiB
from lynx.validate import POSITIVE

DEFAULT_SEARCH_TIME_LIMIT_S = 600.0
"""`--search-time-limit`'s default: ten minutes, then the search ranks what it planned and says the smallest bound of
what it left. Every dense search of benchmarks/config_search.py, and the Qwen3-235B one, ends well before it; a
DeepSeek-V3 search on 1,024 GPUs (7.4M candidates, bounds without its stages' recomputation) does not."""

EXIT_NONE_FITS = 3
"""`lynx plan --compare`: no method gives a plan that fits the budget (documented in README)."""

if TYPE_CHECKING:
    from lynx.cli.plan_flags import PlanFlags
    from lynx.plan import Plan
    from lynx.problem import PlanProblem, PlanResult
    from lynx.schedule import Schedule


_FUSION_PANEL = "Megatron-Core fusions (docs/costmodel.md)"


def with_vpp(problem: PlanProblem, vpp: int) -> PlanProblem:
    """The problem planned with `vpp` model chunks per rank (validated like every other layout option)."""
    from dataclasses import replace

    from lynx.api import make_problem

    return make_problem(problem.model, problem.hardware, problem.parallel, replace(problem.options, vpp=vpp),
                        problem.graph, problem.kind_graphs)


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


@app.command("plan")
def plan_cmd(
    ctx: typer.Context,
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
    jobs: Annotated[int | None, typer.Option(
        "--jobs", "-j", help="With --gpus: processes searching the tree side by side, this one and J - 1 workers, "
        "each solving a plan's independent stage problems on J threads (the same table; 1: no workers, one "
        "thread) [default: one per CPU this process may use, at most 8].")] = None,
    search_time_limit: Annotated[float, typer.Option(
        "--search-time-limit", help="With --gpus: seconds the search decides candidates for; then it stops, ranks "
        "what it planned and says the smallest time bound of what it left (0: no limit; every dense search of "
        "benchmarks/config_search.py ends well before it).")] = DEFAULT_SEARCH_TIME_LIMIT_S,
    search_png: Annotated[Path | None, typer.Option(
        "--search-png", help="With --gpus: plot every candidate's time against its peak memory (PNG).")] = None,
    target: Annotated[str | None, typer.Option(
        "--target", help="With --gpus: rank by the price on megatron (Megatron-Core with lynx's exported flags and "
        "plugin), torchtitan, or lynx (lynx's own runtime) [default: megatron] (docs/choosing-a-configuration.md)."
    )] = None,
    layers_per_stage: Annotated[str | None, typer.Option(help="Explicit partition, e.g. 7,8,8,9.")] = None,
    budget_gb: Annotated[
        float | None, typer.Option(help="Usable memory per GPU in GiB (default: capacity minus reserve).")
    ] = None,
    bytes_per_param: BytesPerParamOpt = None,
    precision: Annotated[str | None, typer.Option(
        "--precision", help="Static-memory recipe: paper (16 B/param, a layout's default), megatron-bf16 (18, the "
        "default with --gpus: what Megatron-Core's --bf16 runs), megatron-fp16 (20), fp32 (16). With "
        "--from-megatron: the command line's --bf16 / --fp16 unless given.")
    ] = None,
    distributed_optimizer: Annotated[bool | None, typer.Option(
        "--distributed-optimizer/--no-distributed-optimizer", "--use-distributed-optimizer",
        help="Shard fp32 main weights and optimizer state over DP (Megatron's distributed optimizer) "
        "[default: off; searched with --gpus].")] = None,
    use_megatron_fsdp: Annotated[bool, typer.Option(
        "--use-megatron-fsdp", help="Megatron-FSDP with --data-parallel-sharding-strategy (docs/costmodel.md, "
        "\"Fully sharded data parallelism\") [default: off; FSDP2 searched with --gpus].")] = False,
    data_parallel_sharding_strategy: Annotated[str | None, typer.Option(
        "--data-parallel-sharding-strategy", help="Megatron-FSDP's: no_shard (default), optim, optim_grads, "
        "optim_grads_params.")] = None,
    use_torch_fsdp2: Annotated[bool, typer.Option(
        "--use-torch-fsdp2", help="torch FSDP2 (fully_shard): parameters, gradients and optimizer state sharded "
        "over DP x CP, per-layer all-gathers and reduce-scatters, each layer resharded after its forward (Megatron's "
        "default).")] = False,
    torch_fsdp2_no_reshard_after_forward: Annotated[bool, typer.Option(
        "--torch-fsdp2-no-reshard-after-forward", help="With --use-torch-fsdp2: keep each layer's gathered "
        "parameters from its forward to its backward (FSDP's ZeRO-2).")] = False,
    num_distributed_optimizer_instances: Annotated[int | None, typer.Option(
        "--num-distributed-optimizer-instances", help="HSDP: replicas of the sharded state (torchtitan's "
        "data_parallel_replicate_degree); each shards over DP x CP / this.")] = None,
    megatron_fsdp_main_params_dtype: Annotated[str | None, typer.Option(
        "--megatron-fsdp-main-params-dtype", help="Megatron-FSDP's main weights: fp32, bf16, fp16, auto (the "
        "compute weights) [default: the recipe's fp32].")] = None,
    megatron_fsdp_main_grads_dtype: Annotated[str | None, typer.Option(
        "--megatron-fsdp-main-grads-dtype", help="Megatron-FSDP's main gradients: fp32, bf16, fp16, auto (the "
        "compute weights') [default: the recipe's gradient buffer].")] = None,
    megatron_fsdp_grad_comm_dtype: Annotated[str | None, typer.Option(
        "--megatron-fsdp-grad-comm-dtype", help="Megatron-FSDP's gradient reduce-scatter dtype [default: the main "
        "gradients'].")] = None,
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
        "--from-megatron", help="Simulate a Megatron-LM command line (quoted, or a file holding it such as "
        "lynx export megatron's megatron_args.txt) next to lynx's plan; sizes come from it, "
        "--hardware/--dp/--nodes/--budget-gb from lynx's options (docs/export.md).")] = None,
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
    fp8_format: Fp8FormatOpt = None,
    fp8_recipe: Fp8RecipeOpt = None,
    fp8_param_gather: Fp8ParamGatherOpt = False,
    float8_recipe: Float8RecipeOpt = None,
    float8_fsdp_all_gather: Float8AllGatherOpt = False,
    compile: CompileOpt = False,
    grad_reduce_in_bf16: GradReduceBf16Opt = False,
    use_precision_aware_optimizer: PrecisionAwareOpt = False,
    main_grads_dtype: MainGradsDtypeOpt = "fp32",
    main_params_dtype: MainParamsDtypeOpt = "fp32",
    exp_avg_dtype: ExpAvgDtypeOpt = "fp32",
    exp_avg_sq_dtype: ExpAvgSqDtypeOpt = "fp32",
    no_store_param_remainders: NoRemaindersOpt = False,
    optimizer_cpu_offload: CpuOffloadOpt = False,
    optimizer_offload_fraction: OffloadFractionOpt = 1.0,
    overlap_cpu_optimizer_d2h_h2d: OverlapCpuOptimizerOpt = False,
    no_production_overlaps: Annotated[bool, typer.Option(
        "--no-production-overlaps", help="With --gpus: do not assume Megatron's production overlaps (grad reduce, "
        "param gather with the distributed optimizer, TP comm overlap with SP) on every candidate; the overlap flags "
        "given stay on.")] = False,
) -> None:
    """Plan recomputation and partitioning for a model on a cluster, and predict its iteration.

    With --compare the exit code is 3 when no method fits the memory budget (the table says so)."""
    params = {k: v for k, v in locals().items() if k != "ctx"}  # first: the options only
    from lynx.cli.modes import Mode, check_plan_mode, given
    from lynx.cli.plan_flags import PlanFlags

    f = PlanFlags(typed=given(ctx), **params)
    mode = check_plan_mode(params, f.typed)
    _check_plan_outputs(out, gantt, memory_png)
    check_outputs(**{"--search-png": (search_png, PLOT_FORMATS)})
    from lynx.search.parallel import MAX_JOBS
    from lynx.validate import Range

    check_ints(**{"--gpus": (gpus, POSITIVE), "--top": (top, POSITIVE), "--jobs": (jobs, Range(gt=0, le=MAX_JOBS)),
                  "--vpp": (vpp, POSITIVE), "--nodes": (nodes, POSITIVE)})
    check_floats(**{"--search-time-limit": (search_time_limit, Range(ge=0))})
    if f.fusions_given() and profile:
        raise SpecError(f"{f.fusions_given()[0]} with --profile: a profile measured the kernels it ran; the fusion "
                        "flags change the analytic model only")
    if mode is Mode.SEARCH:
        from lynx.cli.search import search_cmd

        return search_cmd(f)
    if mode is Mode.MEGATRON:
        from lynx.cli.export import plan_from_megatron_flags

        return plan_from_megatron_flags(f)
    _plan_layout(f)


def _layout_dp(f: PlanFlags, tp: int, pp: int, cp: int) -> int:
    """--dp, else 1, else with --nodes GPUs / (TP x CP x PP) (idle GPUs refused unless --allow-idle-gpus)."""
    if f.nodes is None or f.dp is not None:
        return 1 if f.dp is None else f.dp
    from lynx.cli.search import cluster_gpus, derive_dp
    from lynx.spec import load_hardware

    hw = load_hardware(f.hardware)
    per_node = hw.devices_per_node
    cluster_gpus(hw, None, f.nodes)  # a count beyond any cluster: one line naming --nodes
    if tp * cp * pp > f.nodes * per_node:  # the layout check says how many nodes it needs
        return 1
    return derive_dp(tp, pp, None, f.nodes * per_node, f"--nodes {f.nodes} x {per_node} per node",
                     f.allow_idle_gpus, cp)  # TP x CP ranks per pipeline stage


def _plan_layout(f: PlanFlags) -> None:
    """`lynx plan` of one layout: one method, or every method side by side (--compare)."""
    from lynx.cli.export import budget_warnings
    from lynx.cli.plan_flags import single_request
    from lynx.methods import available_methods

    check_ints(**{"--tp": (f.tp, POSITIVE), "--pp": (f.pp, POSITIVE), "--cp": (f.cp, POSITIVE)})
    tp, pp, cp = f.tp or 4, f.pp or 4, f.cp or 1  # the single layout's defaults (0 was refused above)
    req = single_request(f, tp, pp, _layout_dp(f, tp, pp, cp), cp)
    if f.profile:
        from dataclasses import replace

        if req.model.kv_repeat:  # the profile's graph would be planned in its place, the field read but not honoured
            raise SpecError(f"model {req.model.name!r}: kv_repeat true with --profile: the profiler measures "
                            "torchtitan 0.3.0's block (a fused QKV), not the 2024 attention; plan kv_repeat without "
                            "--profile")
        req = replace(req, graph=_load_profile_graph(f.profile, f.db))
    problem = req.problem()
    for w in budget_warnings(f.budget_gb, problem.hardware):  # after the checks: a NaN has been refused
        err_console.print(f"[yellow]warning:[/yellow] {w}", highlight=False)
    graph = req.graph
    if graph is not None and graph.meta.device and graph.meta.device != problem.hardware.device.name:
        err_console.print(
            f"[yellow]warning:[/yellow] profile {f.profile} was measured on {graph.meta.device!r} "
            f"({graph.meta.dtype}); planning for {problem.hardware.device.name} memory with its times and sizes"
        )
    method = req.method if req.method != "lynx" or "lynx" in available_methods() else "full"
    par, vpp = problem.parallel, problem.options.vpp
    kind = par.cp_comm_type
    cp_text = f" CP {cp}" + (f" ({kind})" if kind != "p2p" else "") if cp > 1 else ""
    fusions = f.fusions_given()
    ep_text = f" EP {par.ep}" + (f" ETP {par.expert_tp}" if par.expert_tp != tp else "") if par.ep > 1 else ""
    title = (f"{problem.model.name} on {problem.hardware.name}: TP {tp}{cp_text}{ep_text} PP {pp}"
             f"{f' VPP {vpp}' if vpp > 1 else ''} DP {par.dp}{' SP' if par.sequence_parallel else ''}, micro-batch "
             f"{par.micro_batch_size}, global batch {par.global_batch_size}, seq {par.seq_length}, "
             f"{par.num_microbatches} micro-batches" + (f"; {' '.join(fusions)}" if fusions else "")
             + precision_note(problem.model))
    none_fits = False
    if f.compare:
        plan, none_fits = _compare(problem, method, title, f.as_json, f.gantt is not None or f.memory_png is not None)
    else:
        plan = _single(problem, method, title, f.as_json)
    if plan is not None:
        if f.out is not None:
            plan.save(f.out)
            err_console.print(f"wrote {f.out}")
        _emit_plots(plan, f.gantt, f.memory_png)
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


# graph, methods and presets register after plan and simulate (the help lists commands in that order)
from lynx.cli import catalog as _catalog  # noqa: E402,F401
