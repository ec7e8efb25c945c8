"""The FP8 option group (Megatron-LM's names) that `lynx plan` and `lynx memory` share, and the step that puts it on
a problem's model. One group, additive: a command takes the three options and calls `with_fp8`."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Annotated

import typer

from lynx.errors import SpecError
from lynx.fp8 import Fp8, float8_from_flags, fp8_from_flags

if TYPE_CHECKING:
    from lynx.problem import PlanProblem
    from lynx.spec import ModelSpec

FP8_PANEL = "FP8 (Megatron-Core with TransformerEngine; docs/costmodel.md)"

Fp8FormatOpt = Annotated[str | None, typer.Option(
    "--fp8-format", help="FP8 linear layers: hybrid (E4M3 forward, E5M2 gradients) or e4m3. Off without it; needs a "
    "device with an FP8 peak (H100).", rich_help_panel=FP8_PANEL)]
Fp8RecipeOpt = Annotated[str | None, typer.Option(
    "--fp8-recipe", help="Scaling: delayed (Megatron's default), tensorwise, blockwise (mxfp8 is Blackwell-only).",
    rich_help_panel=FP8_PANEL)]
Fp8ParamGatherOpt = Annotated[bool, typer.Option(
    "--fp8-param-gather", help="FP8 weights (no 16-bit copy); the distributed optimizer gathers them in FP8.",
    rich_help_panel=FP8_PANEL)]


TITAN_PANEL = "torchtitan (family torchtitan-llama3; docs/costmodel.md)"

Float8RecipeOpt = Annotated[str | None, typer.Option(
    "--float8-recipe", help="torchtitan's float8 converter (torchao Float8Linear): tensorwise, rowwise or "
    "rowwise_with_gw_hp. Off without it.", rich_help_panel=TITAN_PANEL)]
Float8AllGatherOpt = Annotated[bool, typer.Option(
    "--float8-fsdp-all-gather", help="enable_fsdp_float8_all_gather: FSDP gathers the weights in FP8 (tensorwise).",
    rich_help_panel=TITAN_PANEL)]
CompileOpt = Annotated[bool, typer.Option(
    "--compile", help="torchtitan's --compile.enable: each block compiled (its memory-bound ops fused).",
    rich_help_panel=TITAN_PANEL)]


def fp8_option(fmt: str | None, recipe: str | None, param_gather: bool, float8_recipe: str | None = None,
               float8_all_gather: bool = False) -> Fp8 | None:
    """The options as the typed setting (None: 16-bit): Megatron's (TransformerEngine) or torchtitan's
    (torchao); bad values and both at once are one `lynx: error:` line."""
    te = fp8_from_flags(fmt, recipe, param_gather)
    ao = float8_from_flags(float8_recipe, float8_all_gather)
    if te is not None and ao is not None:
        raise SpecError("--fp8-format with --float8-recipe: Megatron-Core's FP8 (TransformerEngine) and "
                        "torchtitan's (torchao) are two frameworks' layers; give one")
    return te or ao


def precision_note(model: ModelSpec) -> str:
    """'; <FP8 setting>; torch.compile' for a title line ('' for a 16-bit, uncompiled model)."""
    return (f"; {model.fp8.describe()}" if model.fp8 is not None else "") + ("; torch.compile" if model.compiled
                                                                            else "")


def with_fp8(problem: PlanProblem, fp8: Fp8 | None, compiled: bool = False) -> PlanProblem:
    """The problem with its model's FP8 setting (and torchtitan's compile), the graph rebuilt and the inputs
    checked again (nothing to do without either)."""
    if fp8 is None and not compiled:
        return problem
    from lynx.api import make_problem

    model = replace(problem.model, fp8=fp8 or problem.model.fp8, compiled=compiled or problem.model.compiled)
    return make_problem(model, problem.hardware, problem.parallel, problem.options)


__all__ = ["FP8_PANEL", "TITAN_PANEL", "CompileOpt", "Float8AllGatherOpt", "Float8RecipeOpt", "Fp8FormatOpt",
           "Fp8ParamGatherOpt", "Fp8RecipeOpt", "fp8_option", "precision_note", "with_fp8"]
