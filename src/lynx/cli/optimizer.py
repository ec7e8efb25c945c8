"""The gradient-buffer and optimizer-dtype option group (Megatron-LM's names) that `lynx plan` takes, read into
`lynx.cost.static_memory.OptimizerPrecision` by the same reader as `--from-megatron` (`export.megatron_optimizer`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import typer

from lynx.cost.static_memory import OptimizerPrecision

OPTIMIZER_FLAGS = ("grad_reduce_in_bf16", "use_precision_aware_optimizer", "main_grads_dtype", "main_params_dtype",
                   "exp_avg_dtype", "exp_avg_sq_dtype", "no_store_param_remainders", "optimizer_cpu_offload",
                   "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d")
"""The group's parameter names (what a plan file fixes: `lynx memory --plan` refuses them beside it)."""

OPTIMIZER_PANEL = ("Gradient and optimizer dtypes, optimizer CPU offload (Megatron-Core, under --precision "
                   "megatron-bf16; docs/export.md)")

GradReduceBf16Opt = Annotated[bool, typer.Option(
    "--grad-reduce-in-bf16", help="Accumulate and reduce gradients in bf16 (2 B a parameter, half the DP bytes).",
    rich_help_panel=OPTIMIZER_PANEL)]
PrecisionAwareOpt = Annotated[bool, typer.Option(
    "--use-precision-aware-optimizer", help="TransformerEngine's FusedAdam keeps the state at the dtypes below.",
    rich_help_panel=OPTIMIZER_PANEL)]
MainGradsDtypeOpt = Annotated[str, typer.Option(
    "--main-grads-dtype", help="fp32 (default) or bf16 (a bf16 gradient buffer).", rich_help_panel=OPTIMIZER_PANEL)]
MainParamsDtypeOpt = Annotated[str, typer.Option(
    "--main-params-dtype", help="fp32 (default; stored as 16-bit remainders beside bf16 parameters) or fp16.",
    rich_help_panel=OPTIMIZER_PANEL)]
ExpAvgDtypeOpt = Annotated[str, typer.Option(
    "--exp-avg-dtype", help="Adam's first moment: fp32 (default), bf16, fp16, fp8.", rich_help_panel=OPTIMIZER_PANEL)]
ExpAvgSqDtypeOpt = Annotated[str, typer.Option(
    "--exp-avg-sq-dtype", help="Adam's second moment: fp32 (default), bf16, fp16, fp8.",
    rich_help_panel=OPTIMIZER_PANEL)]
NoRemaindersOpt = Annotated[bool, typer.Option(
    "--no-store-param-remainders", help="Keep whole fp32 main parameters with the precision-aware optimizer.",
    rich_help_panel=OPTIMIZER_PANEL)]
CpuOffloadOpt = Annotated[bool, typer.Option(
    "--optimizer-cpu-offload", help="Step part of the optimizer on the host: its fp32 state there, the gradients "
    "and parameters copied each step (needs --use-precision-aware-optimizer).", rich_help_panel=OPTIMIZER_PANEL)]
OffloadFractionOpt = Annotated[float, typer.Option(
    "--optimizer-offload-fraction", help="Share of the optimizer's elements stepped on the host (Megatron's "
    "default 1.0).", rich_help_panel=OPTIMIZER_PANEL)]
OverlapCpuOptimizerOpt = Annotated[bool, typer.Option(
    "--overlap-cpu-optimizer-d2h-h2d", help="Pipeline the gradient copies, the host step and the parameter copies "
    "per parameter.", rich_help_panel=OPTIMIZER_PANEL)]


def optimizer_option(params: Mapping[str, Any]) -> OptimizerPrecision:
    """The group's options, by their parameter names (`OPTIMIZER_FLAGS`), as the typed setting; a bad dtype is
    one `lynx: error:` line naming the option."""
    from lynx.export.megatron_optimizer import optimizer_of

    p = {n: params[n] for n in OPTIMIZER_FLAGS}
    return optimizer_of({"--grad-reduce-in-bf16": p["grad_reduce_in_bf16"],
                         "--use-precision-aware-optimizer": p["use_precision_aware_optimizer"],
                         "--main-grads-dtype": p["main_grads_dtype"], "--main-params-dtype": p["main_params_dtype"],
                         "--exp-avg-dtype": p["exp_avg_dtype"], "--exp-avg-sq-dtype": p["exp_avg_sq_dtype"],
                         "--no-store-param-remainders": p["no_store_param_remainders"],
                         "--optimizer-cpu-offload": p["optimizer_cpu_offload"],
                         "--optimizer-offload-fraction": p["optimizer_offload_fraction"],
                         "--overlap-cpu-optimizer-d2h-h2d": p["overlap_cpu_optimizer_d2h_h2d"]}, where="")


__all__ = ["OPTIMIZER_FLAGS", "OPTIMIZER_PANEL", "CpuOffloadOpt", "ExpAvgDtypeOpt", "ExpAvgSqDtypeOpt",
           "GradReduceBf16Opt", "MainGradsDtypeOpt", "MainParamsDtypeOpt", "NoRemaindersOpt", "OffloadFractionOpt",
           "OverlapCpuOptimizerOpt", "PrecisionAwareOpt", "optimizer_option"]
