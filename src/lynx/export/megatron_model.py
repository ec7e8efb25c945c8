"""A lynx ModelSpec as Megatron-LM model flags, and back.

GPT is Megatron's default architecture (LayerNorm, GELU, learned positions, biases, tied embeddings). The
LLaMA family (issue 10) adds fields to ModelSpec (`family`, `num_query_groups`, `activation`,
`normalization`, `position_embedding`, `tie_embeddings`, `attention`, dropout rates); both directions read
them with `getattr` and use them only when this ModelSpec has them, so this module works before and after
that change lands.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lynx.errors import SpecError
from lynx.spec import ModelSpec

Flag = tuple[str, ...]

# Flags the LLaMA family maps onto ModelSpec fields (name, value).
_FAMILY_FLAGS: dict[str, tuple[str, object]] = {
    "--swiglu": ("activation", "swiglu"),
    "--untie-embeddings-and-output-weights": ("tie_embeddings", False),
}

# Which flag set a field (for the error when this ModelSpec lacks the field).
_ORIGIN: dict[str, str] = {
    "family": "--swiglu/--normalization RMSNorm", "normalization": "--normalization RMSNorm",
    "position_embedding": "--position-embedding-type rope", "num_query_groups": "--num-query-groups",
    "attention": "--attention-backend",
}


def _has(field: str) -> bool:
    return field in {f.name for f in dataclasses.fields(ModelSpec)}


def model_flags(m: ModelSpec, seq_length: int) -> list[Flag]:
    flags: list[Flag] = [
        ("--num-layers", str(m.num_layers)), ("--hidden-size", str(m.hidden_size)),
        ("--ffn-hidden-size", str(m.ffn_hidden_size)), ("--num-attention-heads", str(m.num_attention_heads)),
        ("--seq-length", str(seq_length)), ("--max-position-embeddings", str(m.max_position_embeddings)),
        ("--vocab-size", str(m.vocab_size)),
    ]
    att = float(m.attention_dropout) if m.dropout else 0.0
    hid = float(m.hidden_dropout) if m.dropout else 0.0
    flags += [("--attention-dropout", f"{att:g}"), ("--hidden-dropout", f"{hid:g}")]
    if m.activation == "swiglu":
        flags.append(("--swiglu",))
    if m.normalization == "rmsnorm":
        flags.append(("--normalization", "RMSNorm"))
    if m.position_embedding == "rope":
        flags += [("--position-embedding-type", "rope"), ("--rotary-base", f"{m.rotary_base:g}")]
    if m.family == "llama":
        flags.append(("--disable-bias-linear",))
    if not m.tie_embeddings:
        flags.append(("--untie-embeddings-and-output-weights",))
    groups = m.num_query_groups
    if groups != m.num_attention_heads:
        flags += [("--group-query-attention",), ("--num-query-groups", str(groups))]
    # lynx prices the attention it was told about: unfused keeps the s x s tensors, flash does not
    flags.append(("--attention-backend", "flash" if m.attention == "flash" else "unfused"))
    return flags


def attention_of(k: Mapping[str, Any]) -> str:
    """The attention Megatron-Core runs: `--attention-backend` when given (flash / fused: a fused kernel;
    unfused / local: the s x s tensors); else flash with `--use-flash-attn` or TransformerEngine (Megatron-Core's
    default `--transformer-impl transformer_engine` picks a fused backend, `attention_backend` auto); only
    `--transformer-impl local` without `--use-flash-attn` runs unfused attention."""
    backend = k.get("--attention-backend")
    if backend in ("flash", "fused"):
        return "flash"
    if backend in ("unfused", "local"):
        return "standard"
    if k.get("--use-flash-attn"):
        return "flash"
    return "standard" if k.get("--transformer-impl") == "local" else "flash"


def model_from_flags(k: Mapping[str, Any], warn: list[str]) -> ModelSpec:
    """The ModelSpec a parsed Megatron command line describes (`k`: flag -> converted value)."""
    layers, hidden, seq = int(k["--num-layers"]), int(k["--hidden-size"]), int(k["--seq-length"])
    extra: dict[str, Any] = {}
    origin = dict(_ORIGIN)
    for flag, (field, value) in _FAMILY_FLAGS.items():
        if k.get(flag):
            extra[field] = value
            origin[field] = flag
    norm, pos = k.get("--normalization"), k.get("--position-embedding-type")
    if norm not in (None, "LayerNorm", "RMSNorm"):
        raise SpecError(f"--from-megatron: --normalization {norm}: lynx models LayerNorm and RMSNorm")
    if pos not in (None, "learned_absolute", "rope"):
        raise SpecError(f"--from-megatron: --position-embedding-type {pos}: lynx models learned_absolute and rope")
    if norm == "RMSNorm":
        extra["normalization"] = "rmsnorm"
    if pos == "rope":
        extra["position_embedding"] = "rope"
    if k.get("--group-query-attention") and "--num-query-groups" in k:
        extra["num_query_groups"] = int(k["--num-query-groups"])
    backend = k.get("--attention-backend")
    extra["attention"] = attention_of(k)
    if k.get("--rotary-base") is not None:
        extra["rotary_base"] = float(k["--rotary-base"])
    llama = {"--swiglu": extra.get("activation") == "swiglu", "--normalization RMSNorm": norm == "RMSNorm",
             "--position-embedding-type rope": pos == "rope"}
    if any(llama.values()):
        if not all(llama.values()):
            raise SpecError(f"--from-megatron: {', '.join(f for f, v in llama.items() if v)} without "
                            f"{', '.join(f for f, v in llama.items() if not v)}: lynx models GPT (none of them) "
                            "or the LLaMA family (all three)")
        extra["family"] = "llama"
    drops = {f: float(k.get(f, 0.1)) for f in ("--attention-dropout", "--hidden-dropout")}
    if _has("hidden_dropout"):
        extra["attention_dropout"], extra["hidden_dropout"] = drops["--attention-dropout"], drops["--hidden-dropout"]
    unsupported = sorted(f for f in extra if not _has(f))
    if unsupported == ["attention"] and extra["attention"] == "standard":
        unsupported = []
    elif unsupported == ["attention"]:
        warn.append(f"--attention-backend {backend}: this lynx prices unfused attention")
        unsupported = []
    if unsupported:
        flags = sorted({origin[f] for f in unsupported if f != "family"} or {origin["family"]})
        raise SpecError(f"--from-megatron: {', '.join(flags)} (the LLaMA family) is not modelled by this lynx")
    extra = {f: v for f, v in extra.items() if _has(f)}
    return ModelSpec(
        name="megatron-args", num_layers=layers, hidden_size=hidden,
        num_attention_heads=int(k["--num-attention-heads"]),
        ffn_hidden_size=int(k.get("--ffn-hidden-size", 4 * hidden)), vocab_size=int(k.get("--vocab-size", 51200)),
        max_position_embeddings=int(k.get("--max-position-embeddings", seq)),
        dropout=any(d > 0 for d in drops.values()), **extra,
    )
