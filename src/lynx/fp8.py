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


class Fp8Engine(str, Enum):
    """Which library runs the FP8 linear layers."""

    TE = "te"
    """TransformerEngine under Megatron-Core (--fp8-format, --fp8-recipe; `lynx.cost.fp8`)."""
    TORCHAO = "torchao"
    """torchao's ``Float8Linear`` under torchtitan (its float8 model converter; `lynx.cost.float8_torchao`):
    dynamic scaling computed every call, the 16-bit input and weight kept for backward."""


class Fp8Recipe(str, Enum):
    """--fp8-recipe: how TransformerEngine scales each FP8 tensor (Megatron-Core's Fp8Recipe, less ``custom``,
    whose quantizer is user code lynx cannot price); and torchao's recipe names (``recipe_name`` of torchtitan's
    float8 converter: tensorwise, rowwise, rowwise_with_gw_hp)."""

    DELAYED = "delayed"
    """DelayedScaling: one scale per tensor from the amax history of earlier iterations; the cast, the transpose
    and the amax come out of one fused kernel."""
    TENSORWISE = "tensorwise"
    """Float8CurrentScaling: one scale per tensor from this tensor's own amax: an amax pass before the cast."""
    BLOCKWISE = "blockwise"
    """Float8BlockScaling: fp32 scales per 1 x 128 block of activations and gradients (128 x 128 for weights)."""
    ROWWISE = "rowwise"
    """torchao only: one fp32 scale per row of each GEMM operand, along its reduction dimension (so the input and
    the output gradient are quantized twice, once per GEMM that reads them); torchtitan's default."""
    ROWWISE_GW_HP = "rowwise_with_gw_hp"
    """torchao only: rowwise, with the weight-gradient GEMM left in 16 bits (its operands not quantized)."""
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


TE_RECIPES = (Fp8Recipe.DELAYED, Fp8Recipe.TENSORWISE, Fp8Recipe.BLOCKWISE, Fp8Recipe.MXFP8)
TORCHAO_RECIPES = (Fp8Recipe.TENSORWISE, Fp8Recipe.ROWWISE, Fp8Recipe.ROWWISE_GW_HP)


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
    optimizer all-gathers them in FP8 and no 16-bit copy of them exists. With torchao:
    ``enable_fsdp_float8_all_gather`` (tensorwise only): FSDP2 casts each weight's shard to FP8 and all-gathers it in
    FP8; the sharded parameters stay as they are."""
    engine: Fp8Engine = Fp8Engine.TE

    def __post_init__(self) -> None:
        valid = TORCHAO_RECIPES if self.engine is Fp8Engine.TORCHAO else TE_RECIPES
        if self.recipe not in valid:
            raise SpecError(f"recipe {self.recipe.value!r} is not a {self.engine.value} recipe; valid: "
                            f"{', '.join(r.value for r in valid)}")
        if self.engine is Fp8Engine.TORCHAO and self.param_gather and self.recipe is not Fp8Recipe.TENSORWISE:
            raise SpecError(f"FSDP's float8 all-gather (enable_fsdp_float8_all_gather) needs torchao's tensorwise "
                            f"recipe, got {self.recipe.value} (torchtitan: \"all distributed communication is done in "
                            "high precision\" with rowwise)")

    def flags(self) -> tuple[str, ...]:
        """The Megatron-LM command-line flags that set this (what `lynx export megatron` writes)."""
        if self.engine is not Fp8Engine.TE:
            raise SpecError(f"Megatron-Core runs TransformerEngine's FP8; this plan prices {self.describe()} "
                            "(torchtitan's converter): plan with --fp8-format / --fp8-recipe for Megatron-Core")
        out = ("--fp8-format", self.format.value, "--fp8-recipe", self.recipe.value)
        return out + (("--fp8-param-gather",) if self.param_gather else ())

    def describe(self) -> str:
        if self.engine is Fp8Engine.TORCHAO:
            return f"torchao Float8 {self.recipe.value}" + (" (FP8 all-gather)" if self.param_gather else "")
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
                        f"{', '.join(x.value for x in TE_RECIPES)}") from None
    if r not in TE_RECIPES:
        raise SpecError(f"{where}--fp8-recipe {recipe!r} is torchao's (torchtitan); Megatron-Core's: "
                        f"{', '.join(x.value for x in TE_RECIPES)}")
    return Fp8(f, r, param_gather)


def float8_from_flags(recipe: str | None, all_gather: bool, where: str = "") -> Fp8 | None:
    """torchtitan's float8 converter (torchao) from its recipe name and ``enable_fsdp_float8_all_gather``; None
    without a recipe (the all-gather alone is refused, as it does nothing)."""
    where = f"{where}: " if where else ""
    if recipe is None:
        if all_gather:
            raise SpecError(f"{where}--float8-fsdp-all-gather needs --float8-recipe tensorwise")
        return None
    try:
        r = Fp8Recipe(recipe)
    except ValueError:
        r = None
    if r not in TORCHAO_RECIPES:
        raise SpecError(f"{where}--float8-recipe {recipe!r}; valid: {', '.join(x.value for x in TORCHAO_RECIPES)}")
    assert r is not None
    if all_gather and r is not Fp8Recipe.TENSORWISE:
        raise SpecError(f"{where}--float8-fsdp-all-gather needs --float8-recipe tensorwise, got {r.value} (torchtitan: "
                        "rowwise recipes communicate in high precision)")
    try:
        return Fp8(Fp8Format.HYBRID, r, all_gather, Fp8Engine.TORCHAO)
    except SpecError as e:
        raise SpecError(f"{where}{e}") from None


__all__ = ["TE_RECIPES", "TORCHAO_RECIPES", "Fp8", "Fp8Engine", "Fp8Format", "Fp8Recipe", "float8_from_flags",
           "fp8_from_flags"]
