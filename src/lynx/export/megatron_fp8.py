"""Megatron-LM's FP8 flags (megatron/training/arguments.py, `_add_transformer_engine_args`), read into
`ModelSpec.fp8` and written back.

Read: ``--fp8-format`` (e4m3 | hybrid; off without it), ``--fp8-recipe`` (delayed | tensorwise | blockwise; mxfp8 is
Blackwell-only and refused with the reason), ``--fp8-param-gather``. The delayed-scaling knobs (``--fp8-margin``,
``--fp8-interval``, ``--fp8-amax-history-len``, ``--fp8-amax-compute-algo``) change neither time nor memory beyond a
few kilobytes of amax history: taken and not priced. Flags that change what runs in FP8 in ways lynx does not price
are refused with one line each (`REFUSED`), never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lynx.fp8 import Fp8, fp8_from_flags
from lynx.spec import ModelSpec

STR_FLAGS = ("--fp8-format", "--fp8-recipe", "--fp8-amax-compute-algo")
INT_FLAGS = ("--fp8-margin", "--fp8-interval", "--fp8-amax-history-len", "--num-layers-at-start-in-bf16",
             "--num-layers-at-end-in-bf16")
"""Taken without effect: the delayed-scaling knobs, and the BF16 layer counts (used only with the refused
--first-last-layers-bf16)."""
BOOL_FLAGS = ("--fp8-param-gather",)

REFUSED = {
    "--first-last-layers-bf16": "BF16 first and last layers among FP8 ones; lynx prices every layer alike",
    "--no-fp8-wgrad": "weight gradients in BF16 under FP8",
    "--disable-fp8-wgrad": "weight gradients in BF16 under FP8",
    "--fp8-dot-product-attention": "FP8 core attention",
    "--fp8-multi-head-attention": "FP8 multi-head attention",
    "--fp4-format": "FP4 (NVFP4) layers",
    "--fp8-quantizer-factory": "a custom FP8 quantizer",
}
"""Megatron flags that change time or memory in ways lynx does not price: refused, not ignored."""


def fp8_of_flags(k: Mapping[str, Any]) -> Fp8 | None:
    """The FP8 setting of a parsed Megatron command line (`k`: flag -> converted value; `REFUSED` flags were
    refused when the line was scanned)."""
    fmt, recipe = k.get("--fp8-format"), k.get("--fp8-recipe")
    return fp8_from_flags(None if fmt is None else str(fmt), None if recipe is None else str(recipe),
                          bool(k.get("--fp8-param-gather")), "--from-megatron")


def fp8_args(m: ModelSpec) -> list[tuple[str, ...]]:
    """The flags that make Megatron run `m`'s FP8 setting (none for a 16-bit model, or a model-like object
    without the field, as `fusion_args` reads it)."""
    fp8: Fp8 | None = getattr(m, "fp8", None)
    if fp8 is None:
        return []
    f = fp8.flags()
    out: list[tuple[str, ...]] = [tuple(f[0:2]), tuple(f[2:4])]
    return out + ([("--fp8-param-gather",)] if fp8.param_gather else [])


__all__ = ["BOOL_FLAGS", "INT_FLAGS", "REFUSED", "STR_FLAGS", "fp8_args", "fp8_of_flags"]
