"""A lynx ModelSpec as Megatron-LM model flags, and back.

GPT is Megatron's default architecture (LayerNorm, GELU, learned positions, biases, tied embeddings). Each of
Megatron-Core's switches (--swiglu / --squared-relu, --normalization, --position-embedding-type,
--disable-bias-linear / --add-qkv-bias, --group-query-attention, --untie-embeddings-and-output-weights, the
attention backend, --rotary-base) maps onto one ModelSpec field, both ways.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lynx.errors import SpecError
from lynx.export.megatron_fp8 import fp8_args
from lynx.export.megatron_fusion import fusion_args
from lynx.export.megatron_moe import moe_flags
from lynx.spec import ModelSpec

Flag = tuple[str, ...]

def model_flags(m: ModelSpec, seq_length: int) -> list[Flag]:
    flags: list[Flag] = [
        ("--num-layers", str(m.num_layers)), ("--hidden-size", str(m.hidden_size)),
        ("--ffn-hidden-size", str(m.ffn_hidden_size)), ("--num-attention-heads", str(m.num_attention_heads)),
        ("--seq-length", str(seq_length)),
        # a rotary model planned beyond its table: Megatron checks max_position_embeddings >= seq_length
        ("--max-position-embeddings", str(max(m.max_position_embeddings, seq_length)
                                          if m.position_embedding != "learned" else m.max_position_embeddings)),
        ("--vocab-size", str(m.vocab_size)),
    ]
    att = float(m.attention_dropout) if m.dropout else 0.0
    hid = float(m.hidden_dropout) if m.dropout else 0.0
    flags += [("--attention-dropout", f"{att:g}"), ("--hidden-dropout", f"{hid:g}")]
    if m.activation == "swiglu":
        flags.append(("--swiglu",))
    elif m.activation == "squared-relu":
        flags.append(("--squared-relu",))
    if m.normalization == "rmsnorm":
        flags.append(("--normalization", "RMSNorm"))
    if m.position_embedding == "rope":
        flags += [("--position-embedding-type", "rope"), ("--rotary-base", f"{m.rotary_base:g}")]
    if m.position_embedding == "none":
        flags.append(("--position-embedding-type", "none"))
    if m.bias != "all":
        flags.append(("--disable-bias-linear",))
    if m.bias == "qkv":
        flags.append(("--add-qkv-bias",))
    if not m.tie_embeddings:
        flags.append(("--untie-embeddings-and-output-weights",))
    groups = m.num_query_groups
    if groups != m.num_attention_heads:
        flags += [("--group-query-attention",), ("--num-query-groups", str(groups))]
    # lynx prices the attention it was told about: unfused keeps the s x s tensors, flash does not
    flags.append(("--attention-backend", "flash" if m.attention == "flash" else "unfused"))
    # --transformer-impl local and the --no-*-fusion flags the plan priced; the FP8 flags; MoE / MLA (`megatron_moe`)
    return flags + fusion_args(m) + fp8_args(m) + moe_flags(m)


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


def _family_of(fields: Mapping[str, Any], groups: int, heads: int) -> str:
    """gpt or llama when the switches are exactly theirs (their layers, their runtime), else mcore."""
    for name in ("gpt", "llama"):
        from lynx.families import get_family

        d = get_family(name).defaults
        same = all(fields[f] == d[f] for f in ("activation", "normalization", "position_embedding", "bias"))
        if same and (name == "llama" or groups == heads):
            return name
    return "mcore"


def model_from_flags(k: Mapping[str, Any], warn: list[str]) -> ModelSpec:
    """The ModelSpec a parsed Megatron command line describes (`k`: flag -> converted value). Each switch is
    read on its own, as Megatron-Core's TransformerConfig does; the family is gpt or llama when the switches are
    exactly those models', else mcore (`lynx.families.mcore`)."""
    layers, hidden, seq = int(k["--num-layers"]), int(k["--hidden-size"]), int(k["--seq-length"])
    # --use-rotary-position-embeddings: Megatron-LM's older switch for rope (it sets position_embedding_type)
    legacy = "rope" if k.get("--use-rotary-position-embeddings") else "learned_absolute"
    norm, pos = k.get("--normalization", "LayerNorm"), k.get("--position-embedding-type", legacy)
    if norm not in ("LayerNorm", "RMSNorm"):
        raise SpecError(f"--from-megatron: --normalization {norm}: lynx models LayerNorm and RMSNorm")
    if pos not in ("learned_absolute", "rope", "none"):
        raise SpecError(f"--from-megatron: --position-embedding-type {pos}: lynx models learned_absolute, rope "
                        "and none")
    if k.get("--swiglu") and k.get("--squared-relu"):
        raise SpecError("--from-megatron: --swiglu and --squared-relu both given; Megatron takes one activation")
    heads = int(k["--num-attention-heads"])
    groups = int(k["--num-query-groups"]) if k.get("--group-query-attention") and "--num-query-groups" in k \
        else heads
    fields: dict[str, Any] = {
        "activation": "swiglu" if k.get("--swiglu") else "squared-relu" if k.get("--squared-relu") else "gelu",
        "normalization": "rmsnorm" if norm == "RMSNorm" else "layernorm",
        "position_embedding": {"learned_absolute": "learned", "rope": "rope", "none": "none"}[str(pos)],
        "bias": ("qkv" if k.get("--add-qkv-bias") else "none") if k.get("--disable-bias-linear") else "all",
    }
    drops = {f: float(k.get(f, 0.1)) for f in ("--attention-dropout", "--hidden-dropout")}
    extra: dict[str, Any] = {"attention": attention_of(k), "num_query_groups": groups,
                             "attention_dropout": drops["--attention-dropout"],
                             "hidden_dropout": drops["--hidden-dropout"],
                             "tie_embeddings": not k.get("--untie-embeddings-and-output-weights")}
    if k.get("--rotary-base") is not None:
        extra["rotary_base"] = float(k["--rotary-base"])
    return ModelSpec(
        name="megatron-args", num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        ffn_hidden_size=int(k.get("--ffn-hidden-size", 4 * hidden)), vocab_size=int(k.get("--vocab-size", 51200)),
        max_position_embeddings=int(k.get("--max-position-embeddings", seq)),
        dropout=any(d > 0 for d in drops.values()), family=_family_of(fields, groups, heads), **fields, **extra,
    )
