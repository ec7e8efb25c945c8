"""FP8 training as Megatron-Core runs it (TransformerEngine's FP8 linear layers): the typed setting a model carries.

Megatron-Core 0.16.1's TransformerConfig (megatron/core/transformer/transformer_config.py): ``fp8`` is the format
(``--fp8-format e4m3|hybrid``), ``fp8_recipe`` the scaling recipe (``--fp8-recipe``: delayed, tensorwise,
blockwise, mxfp8, custom; default delayed), ``fp8_param`` keeps the GEMM weights in FP8 (``--fp8-param-gather``:
the distributed optimizer gathers them in FP8). The pricing is `lynx.cost.fp8` (time) and `lynx.cost.fp8_memory`
(static memory); docs/costmodel.md "FP8" lists every rule and its source. Data only: nothing here prices.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from lynx.errors import SpecError


class Fp8Format(str, Enum):
    """--fp8-format: which FP8 encodings TransformerEngine uses (recipe.Format)."""

    HYBRID = "hybrid"
    """E4M3 for activations and weights, E5M2 for the gradients (the format every NVIDIA recipe uses)."""
    E4M3 = "e4m3"
    """E4M3 everywhere. Same bytes and rates as hybrid: lynx prices the two alike."""


class Fp8Recipe(str, Enum):
    """--fp8-recipe: how TransformerEngine scales each FP8 tensor (Megatron-Core's Fp8Recipe, less ``custom``,
    whose quantizer is user code lynx cannot price)."""

    DELAYED = "delayed"
    """DelayedScaling: one scale per tensor from the amax history of earlier iterations; the cast, the transpose
    and the amax come out of one fused kernel."""
    TENSORWISE = "tensorwise"
    """Float8CurrentScaling: one scale per tensor from this tensor's own amax: an amax pass before the cast."""
    BLOCKWISE = "blockwise"
    """Float8BlockScaling: fp32 scales per 1 x 128 block of activations and gradients (128 x 128 for weights)."""
    MXFP8 = "mxfp8"
    """MXFP8BlockScaling: one E8M0 scale byte per 32 elements; needs tensor cores that take MX scales
    (Blackwell), Megatron-Core's comment: "for Blackwell architecture only". lynx prices Hopper and refuses it
    (`lynx.models.check_fp8`); the name is kept so that the refusal can say why."""

    @property
    def scale_bytes_per_element(self) -> float:
        """Scale bytes per element of an FP8 activation or gradient copy: blockwise keeps one fp32 per 128
        (TransformerEngine Float8BlockQuantizer, 1D blocks), mxfp8 one byte per 32 (MXFP8Quantizer); the
        per-tensor recipes one fp32 per tensor (nothing per element)."""
        return {Fp8Recipe.BLOCKWISE: 4.0 / 128, Fp8Recipe.MXFP8: 1.0 / 32}.get(self, 0.0)

    @property
    def gathers_columnwise(self) -> bool:
        """Whether TransformerEngine all-gathers the column-wise (transposed) copy of a sequence-parallel input:
        the block-scaled recipes do; the per-tensor ones gather the row-wise copy only ("All-gather is not
        supported with FP8 column-wise data", module/linear.py) and transpose the gathered tensor in backward."""
        return self in (Fp8Recipe.BLOCKWISE, Fp8Recipe.MXFP8)


@dataclass(frozen=True, slots=True)
class Fp8:
    """FP8 GEMMs in every transformer layer's linear layers (QKV, projection, FC1 / gate-up, FC2 / down), as
    Megatron-Core with TransformerEngine runs them. Core attention, norms, activations, the embedding and the
    output layer stay in 16 bits (Megatron-Core builds the output layer as its own ColumnParallelLinear)."""

    format: Fp8Format = Fp8Format.HYBRID
    recipe: Fp8Recipe = Fp8Recipe.DELAYED
    """Megatron-Core's default recipe is delayed."""
    param_gather: bool = False
    """--fp8-param-gather (TransformerConfig.fp8_param): the GEMM weights are FP8 parameters; the distributed
    optimizer all-gathers them in FP8 and no 16-bit copy of them exists."""

    def flags(self) -> tuple[str, ...]:
        """The Megatron-LM command-line flags that set this (what `lynx export megatron` writes)."""
        out = ("--fp8-format", self.format.value, "--fp8-recipe", self.recipe.value)
        return out + (("--fp8-param-gather",) if self.param_gather else ())

    def describe(self) -> str:
        return f"FP8 {self.format.value} {self.recipe.value}" + (" (FP8 parameters)" if self.param_gather else "")


def fp8_from_flags(fmt: str | None, recipe: str | None, param_gather: bool, where: str = "") -> Fp8 | None:
    """The setting from Megatron's three flags as strings (the CLI and --from-megatron); None without a format.
    A recipe or --fp8-param-gather without --fp8-format is refused, as Megatron-Core refuses fp8_param alone.
    `where` prefixes the message (a command line's name; empty for lynx's own options)."""
    where = f"{where}: " if where else ""
    if fmt is None:
        if param_gather:
            raise SpecError(f"{where}--fp8-param-gather needs --fp8-format (Megatron-Core: fp8_param must be used "
                            "together with fp8 mode)")
        if recipe is not None:
            raise SpecError(f"{where}--fp8-recipe {recipe} without --fp8-format does nothing; give --fp8-format "
                            "hybrid or e4m3")
        return None
    try:
        f = Fp8Format(fmt)
    except ValueError:
        raise SpecError(f"{where}--fp8-format {fmt!r}; valid: {', '.join(x.value for x in Fp8Format)}") from None
    try:
        r = Fp8Recipe(recipe or Fp8Recipe.DELAYED.value)
    except ValueError:
        extra = " (custom: a user quantizer lynx cannot price)" if recipe == "custom" else ""
        raise SpecError(f"{where}--fp8-recipe {recipe!r}{extra}; valid: "
                        f"{', '.join(x.value for x in Fp8Recipe)}") from None
    return Fp8(f, r, param_gather)


__all__ = ["Fp8", "Fp8Format", "Fp8Recipe", "fp8_from_flags"]
