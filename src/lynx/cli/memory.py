"""`lynx memory`: where each stage's memory goes for a layout and a method."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lynx.cli.app import app
from lynx.cli.common import (
    BusbwOpt,
    BytesPerParamOpt,
    CpCommTypeOpt,
    CpOpt,
    DistOptOpt,
    DpOpt,
    EpOpt,
    EtpOpt,
    GbOpt,
    HardwareOpt,
    HierCpOpt,
    JsonOpt,
    MbOpt,
    ModelOpt,
    NodesOpt,
    PpOpt,
    PrecisionOpt,
    SeqOpt,
    SpOpt,
    TpOpt,
    build_request,
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
    fp8_option,
    precision_note,
    with_fp8,
)
from lynx.cli.optimizer import (
    OPTIMIZER_FLAGS,
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
    optimizer_option,
)
from lynx.errors import SpecError

PLAN_FILE_GIVES = ("model", "hardware", "tp", "pp", "dp", "cp", "cp_comm_type", "hierarchical_cp", "ep", "etp",
                   "sp", "micro_batch", "global_batch", "seq_len", "nodes", "method", "layers_per_stage", "budget_gb",
                   "bytes_per_param", "precision", "distributed_optimizer", "busbw", "recompute_num_layers", "vpp",
                   "fp8_format", "fp8_recipe", "fp8_param_gather", "float8_recipe", "float8_fsdp_all_gather",
                   "compile", *OPTIMIZER_FLAGS)
"""What a plan file fixes: given with --plan, these would be ignored, so they are refused."""



@app.command("memory")
def memory_cmd(
    ctx: typer.Context,
    model: ModelOpt = "gpt-7b",
    hardware: HardwareOpt = "a100-40g-nvlink",
    tp: TpOpt = 4,
    pp: PpOpt = 4,
    dp: DpOpt = 1,
    cp: CpOpt = 1,
    cp_comm_type: CpCommTypeOpt = "p2p",
    hierarchical_cp: HierCpOpt = None,
    ep: EpOpt = 1,
    etp: EtpOpt = None,
    sp: SpOpt = False,
    micro_batch: MbOpt = 8,
    global_batch: GbOpt = 128,
    seq_len: SeqOpt = 1024,
    nodes: NodesOpt = None,
    method: Annotated[str, typer.Option(help="Planning method whose policy to break down (see `lynx methods`).")]
    = "lynx",
    layers_per_stage: Annotated[str | None, typer.Option(help="Explicit partition, e.g. 7,8,8,9.")] = None,
    budget_gb: Annotated[
        float | None, typer.Option(help="Usable memory per GPU in GiB (default: capacity minus reserve).")
    ] = None,
    bytes_per_param: BytesPerParamOpt = None,
    precision: PrecisionOpt = "paper",
    distributed_optimizer: DistOptOpt = False,
    busbw: BusbwOpt = None,
    recompute_num_layers: Annotated[
        int | None, typer.Option(help="Megatron --recompute-num-layers for uniform/block (default: auto).")
    ] = None,
    as_json: JsonOpt = False,
    png: Annotated[Path | None, typer.Option("--png", help="Write stacked bars per stage (PNG).")] = None,
    vpp: Annotated[int, typer.Option("--vpp", "--virtual-pipeline-model-parallel-size",
                                     help="Model chunks per pipeline rank (interleaved 1F1B).")] = 1,
    plan_file: Annotated[Path | None, typer.Option(
        "--plan", help="Break down a saved plan (`lynx plan --out`, also the --gpus search's winner) instead of "
        "planning from the options.")] = None,
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
) -> None:
    """Per-stage memory: parameters, gradients, optimizer state, activations x in-flight micro-batches,
    forward-window holdings, transient working set, embedding/logits, and the headroom to the budget."""
    params = dict(locals())  # first: the options only (the optimizer group is read by name)
    from lynx.api import plan as plan_one
    from lynx.breakdown import stage_memories
    from lynx.cli.modes import flag, given
    from lynx.methods import available_methods
    from lynx.paths import check_output
    from lynx.report.memory import memory_bars, memory_table

    check_output(png, "--png", (".png",))
    fp8 = fp8_option(fp8_format, fp8_recipe, fp8_param_gather, float8_recipe, float8_fsdp_all_gather)
    if plan_file is not None:
        from lynx.plan import Plan, load_plan

        typed = given(ctx)
        for name in PLAN_FILE_GIVES:
            if name in typed:
                raise SpecError(f"{flag(name)} with --plan: the plan file {plan_file} gives the model, layout and "
                                f"options; drop {flag(name)}, or drop --plan to break down the options' plan")
        loaded = load_plan(plan_file)
        plan = Plan.evaluate(*loaded, record=False)
        problem = plan.problem
        par = problem.parallel
        tp, pp, dp, sp, micro_batch = par.tp, par.pp, par.dp, par.sequence_parallel, par.micro_batch_size
        cp = par.cp
        distributed_optimizer = problem.options.distributed_optimizer
    else:
        problem = build_request(model, hardware, tp, pp, dp, sp, micro_batch, global_batch, seq_len, nodes,
                                layers_per_stage, budget_gb, bytes_per_param, recompute_num_layers,
                                precision=precision, distributed_optimizer=distributed_optimizer,
                                busbw_gbps=busbw, cp=cp, cp_comm_type=cp_comm_type, hierarchical_cp=hierarchical_cp,
                                vpp=vpp, ep=ep, etp=etp, optimizer_precision=optimizer_option(params)).problem()
        problem = with_fp8(problem, fp8, compile)
        if method == "lynx" and "lynx" not in available_methods():
            method = "full"
        plan = plan_one(problem, method, record=False)
    stages = stage_memories(plan)
    recipe = problem.static_recipe
    ep_text = f" EP {problem.parallel.ep}" if problem.parallel.ep > 1 else ""
    cp_text = f" CP {cp}" if cp > 1 else ""
    title = (f"{problem.model.name} on {problem.hardware.name}: TP {tp}{cp_text}{ep_text} PP {pp} DP {dp}"
             f"{' SP' if sp else ''}, "
             f"micro-batch {micro_batch}, {plan.result.method}, partition {plan.result.partition}; "
             f"{recipe.name} {recipe.bytes_per_param(dp * cp, distributed_optimizer):g} B/param"
             f"{' (distributed optimizer)' if distributed_optimizer else ''}"
             + precision_note(problem.model))
    if problem.dp_sharding is not None:  # FSDP: the recipe's bytes are sharded as `lynx.cost.fsdp` says
        title = title.split(";")[0] + f"; {recipe.name}, {problem.dp_sharding.label()} over DP x CP" + (
            precision_note(problem.model))
    if as_json:
        print_json({"title": title, "method": plan.result.method,
                    "partition": list(plan.result.partition.layers_per_stage),
                    "stages": [st.to_dict() for st in stages]})
    else:
        console.print(memory_table(stages, title))
    if png is not None:
        memory_bars(stages, png, title)
        err_console.print(f"wrote {png}")
