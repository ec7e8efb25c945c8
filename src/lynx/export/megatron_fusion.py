"""Megatron-LM's --transformer-impl and fusion flags, read into ModelSpec's fusion fields and written back.

Names and defaults are megatron/training/arguments.py's (every fusion on, `store_false` flags `--no-...`;
`--cross-entropy-loss-fusion` off) and Megatron-Core's TransformerConfig fields they set
(`bias_activation_fusion` from `--no-bias-swiglu-fusion` for a gated model, else `--no-bias-gelu-fusion`:
megatron/training/argument_utils.py; `masked_softmax_fusion`, `bias_dropout_fusion`, `apply_rope_fusion`,
`gradient_accumulation_fusion`, `cross_entropy_loss_fusion`, `transformer_impl`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lynx.errors import SpecError
from lynx.spec import FUSION_DEFAULTS, ModelSpec

FLAGS: tuple[tuple[str, str], ...] = (
    ("--no-masked-softmax-fusion", "masked_softmax_fusion"),
    ("--no-bias-dropout-fusion", "bias_dropout_fusion"),
    ("--no-rope-fusion", "apply_rope_fusion"),
    ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion"),
)
"""The `--no-...` flags that map one to one onto a field (the activation's two are `activation_flag`'s)."""

BOOL_FLAGS: tuple[str, ...] = ("--no-bias-swiglu-fusion", "--no-bias-gelu-fusion", "--cross-entropy-loss-fusion",
                               *(f for f, _ in FLAGS))
IMPLS = ("transformer_engine", "local")


def activation_flag(activation: str) -> str:
    """The flag that sets bias_activation_fusion for this activation (argument_utils.py: swiglu's for a gated
    MLP, gelu's otherwise)."""
    return "--no-bias-swiglu-fusion" if activation == "swiglu" else "--no-bias-gelu-fusion"


def check_impl(impl: str, where: str) -> str:
    if impl not in IMPLS:
        raise SpecError(f"{where} {impl!r}: lynx models transformer_engine and local")
    return impl


def fusion_fields(flags: Mapping[str, Any], activation: str, where: str = "--transformer-impl") -> dict[str, Any]:
    """ModelSpec's fusion fields from flags (name -> value; a `--no-...` flag present and true turns its fusion
    off). `local` also plans unfused core attention only when the caller has not chosen one (`attention_of`)."""
    impl = check_impl(str(flags.get("--transformer-impl") or "transformer_engine"), where)
    out: dict[str, Any] = {"transformer_impl": impl,
                           "bias_activation_fusion": not flags.get(activation_flag(activation)),
                           "cross_entropy_loss_fusion": bool(flags.get("--cross-entropy-loss-fusion"))}
    for flag, name in FLAGS:
        out[name] = not flags.get(flag)
    return out


def fusion_args(m: ModelSpec) -> list[tuple[str, ...]]:
    """The flags that make Megatron run `m`'s fusion fields (none at Megatron's defaults)."""
    def field(name: str) -> Any:  # a model-like object without the fields is at Megatron's defaults
        return getattr(m, name, FUSION_DEFAULTS[name])

    if not field("norm_fusion"):
        raise SpecError(f"model {m.name!r}: norm_fusion false prices an eager fp32 RMSNorm, which Megatron-Core does "
                        "not run (TransformerEngine's and Apex's norms are one kernel); plan with norm_fusion true "
                        "to export")
    if getattr(m, "kv_repeat", False):
        raise SpecError(f"model {m.name!r}: kv_repeat true prices torchtitan's 2024 attention (separate wq/wk/wv, K "
                        "and V copied to every query head), which Megatron-Core does not run; plan with kv_repeat "
                        "false to export")
    out: list[tuple[str, ...]] = []
    if field("transformer_impl") != "transformer_engine":
        out.append(("--transformer-impl", str(field("transformer_impl"))))
    if not field("bias_activation_fusion"):
        out.append((activation_flag(m.activation),))
    for flag, name in FLAGS:
        if not field(name):
            out.append((flag,))
    if field("cross_entropy_loss_fusion"):
        out.append(("--cross-entropy-loss-fusion",))
    return out


__all__ = ["BOOL_FLAGS", "FLAGS", "IMPLS", "activation_flag", "check_impl", "fusion_args", "fusion_fields"]
