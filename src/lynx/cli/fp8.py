"""The FP8 option group (Megatron-LM's names) that `lynx plan` and `lynx memory` share, and the step that puts it on
a problem's model. One group, additive: a command takes the three options and calls `with_fp8`."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Annotated

import typer

from lynx.fp8 import Fp8, fp8_from_flags

if TYPE_CHECKING:
    from lynx.problem import PlanProblem

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


def fp8_option(fmt: str | None, recipe: str | None, param_gather: bool) -> Fp8 | None:
    """The options as the typed setting (None: 16-bit); bad values are one `lynx: error:` line."""
    return fp8_from_flags(fmt, recipe, param_gather)


def with_fp8(problem: PlanProblem, fp8: Fp8 | None) -> PlanProblem:
    """The problem with its model's FP8 setting, the graph rebuilt and the inputs checked again (nothing to do
    without FP8)."""
    if fp8 is None:
        return problem
    from lynx.api import make_problem

    return make_problem(replace(problem.model, fp8=fp8), problem.hardware, problem.parallel, problem.options)


__all__ = ["FP8_PANEL", "Fp8FormatOpt", "Fp8ParamGatherOpt", "Fp8RecipeOpt", "fp8_option", "with_fp8"]
