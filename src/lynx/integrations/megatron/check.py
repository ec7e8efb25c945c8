"""Does a lynx plan describe this Megatron-Core model chunk? Each mismatch is refused in one line naming the
plan's side and the model's (`PlanMismatch`): layers, model shape, TP / SP / PP / virtual stages, op names,
dtype, dropout, attention kernel (the plan's `attention` against the layers' core attention), and Megatron's own
recomputation or offloading switched on beside lynx."""

from __future__ import annotations

from typing import Any

from lynx.export.source import ExportSource
from lynx.integrations.megatron import _activation
from lynx.integrations.megatron.layer import computable_ops


class PlanMismatch(ValueError):
    """The plan does not describe the model it is applied to (one line, both sides named)."""


def _refuse(what: str, plan: object, model: object) -> PlanMismatch:
    return PlanMismatch(f"lynx.integrations.megatron: {what}: the plan has {plan}, the model has {model}")


def model_facts(gpt: Any) -> dict[str, object]:
    """The fields of a lynx model / parallel spec, read off a Megatron-Core GPTModel and its config."""
    c = gpt.config
    act = "swiglu" if c.gated_linear_unit else ("gelu" if c.activation_func.__name__ == "gelu" else
                                               c.activation_func.__name__.replace("_", "-"))
    pos = {"learned_absolute": "learned", "rope": "rope", "none": "none"}.get(gpt.position_embedding_type,
                                                                             gpt.position_embedding_type)
    return {
        "num_layers": c.num_layers, "hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads,
        "num_query_groups": c.num_query_groups or c.num_attention_heads, "ffn_hidden_size": c.ffn_hidden_size,
        "normalization": c.normalization.lower(), "activation": act, "position_embedding": pos,
        "bias": "all" if c.add_bias_linear else ("qkv" if c.add_qkv_bias else "none"),
        "tp": c.tensor_model_parallel_size, "pp": c.pipeline_model_parallel_size,
        "sequence_parallel": bool(c.sequence_parallel and c.tensor_model_parallel_size > 1),
        "vpp": c.virtual_pipeline_model_parallel_size or 1,
        "dtype": "bf16" if c.bf16 else "fp16" if c.fp16 else "fp32",
    }


def plan_facts(src: ExportSource) -> dict[str, object]:
    m, par = src.problem.model, src.problem.parallel
    prec = src.problem.options.precision
    return {
        "num_layers": m.num_layers, "hidden_size": m.hidden_size, "num_attention_heads": m.num_attention_heads,
        "num_query_groups": m.num_query_groups or m.num_attention_heads, "ffn_hidden_size": m.ffn_hidden_size,
        "normalization": m.normalization, "activation": m.activation, "position_embedding": m.position_embedding,
        "bias": m.bias, "tp": par.tp, "pp": par.pp, "sequence_parallel": bool(par.sequence_parallel and par.tp > 1),
        "vpp": src.layout.vpp, "dtype": "fp32" if prec == "fp32" else "fp16" if prec == "megatron-fp16" else "bf16",
    }


def check_model(src: ExportSource, gpt: Any) -> None:
    """Refuse (`PlanMismatch`) a plan that does not describe `gpt` (a Megatron-Core GPTModel chunk)."""
    c = gpt.config
    mine, theirs = plan_facts(src), model_facts(gpt)
    for k, v in mine.items():
        if theirs[k] != v:
            raise _refuse(k, f"{k} {v}", f"{k} {theirs[k]}")
    m = src.problem.model
    kernel = _attention_kernel(gpt)
    if kernel is not None and kernel != m.attention:
        plan_side = {"flash": "attention flash (one core_attn op)",
                     "standard": "attention standard (attn_scores, softmax, [attn_dropout,] attn_context)"}
        model_side = {"flash": "lynx's FlashDotProductAttention (attention: flash)",
                      "standard": "Megatron-Core's local DotProductAttention (attention: standard)"}
        hint = ("; build the layer spec with lynx.integrations.megatron.attention.with_flash_attention("
                "get_gpt_layer_local_spec(...))" if m.attention == "flash" else "; plan it with attention: flash")
        plan_has = plan_side.get(m.attention, m.attention)
        raise PlanMismatch(f"lynx.integrations.megatron: attention: the plan has {plan_has}, the model has "
                           f"{model_side[kernel]}{hint}")
    plan_hd = m.hidden_dropout if m.dropout else 0.0
    plan_ad = m.attention_dropout if m.dropout else 0.0
    if (plan_hd, plan_ad) != (c.hidden_dropout, c.attention_dropout):
        raise _refuse("dropout", f"hidden / attention dropout {plan_hd} / {plan_ad}",
                      f"{c.hidden_dropout} / {c.attention_dropout}")
    if c.recompute_granularity is not None:
        raise _refuse("recomputation", "lynx's engine in place of Megatron's recomputation",
                      f"recompute_granularity {c.recompute_granularity!r} (set it to None)")
    for flag in ("fine_grained_activation_offloading", "cpu_offloading", "fp8", "fp4"):
        if getattr(c, flag, None):
            raise _refuse(flag, "no such setting", f"{flag} {getattr(c, flag)!r} (switch it off)")
    why = _activation.check(c)
    if why is not None:
        raise PlanMismatch(f"lynx.integrations.megatron: the model's MLP: {why}")
    unknown = [n for n in src.graph_ops if n not in computable_ops()]
    if unknown:
        raise _refuse("op names", f"ops {', '.join(unknown)}", "no such ops in Megatron-Core's local layer")


def _attention_kernel(gpt: Any) -> str | None:
    """"flash" or "standard": the core attention of the chunk's first layer (None: the chunk has no layers, or
    another kernel, which `_fence.layer_parts` refuses with its own line)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention  # type: ignore[import-untyped]

    from lynx.integrations.megatron.attention import FlashDotProductAttention

    layers = getattr(getattr(gpt, "decoder", None), "layers", None) or []
    if not layers:
        return None
    core = getattr(getattr(layers[0], "self_attention", None), "core_attention", None)
    if isinstance(core, FlashDotProductAttention):
        return "flash"
    return "standard" if isinstance(core, DotProductAttention) else None


def check_layers(src: ExportSource, v: int, numbers: list[int]) -> None:
    """The chunk's layers (0-based global numbers) are those the plan gives virtual stage `v`."""
    lay = src.layout
    if not 0 <= v < len(lay.layers):
        raise _refuse("pipeline stages", f"{len(lay.layers)} (virtual) stages", f"virtual stage {v}")
    want = list(range(lay.first_layer(v), lay.first_layer(v) + lay.layers[v]))
    if numbers != want:
        raise _refuse(f"layers of (virtual) stage {v}", f"layers {_span(want)}", f"layers {_span(numbers)}")


def _span(xs: list[int]) -> str:
    return f"{xs[0]}-{xs[-1]}" if xs else "none"


def check_shape(src: ExportSource, seq: int, batch: int) -> None:
    """The first forward's micro-batch (its sequence length, SP shard undone, and batch size)."""
    par = src.problem.parallel
    if (seq, batch) != (par.seq_length, par.micro_batch_size):
        raise _refuse("micro-batch shape", f"seq_length {par.seq_length}, micro_batch_size {par.micro_batch_size}",
                      f"seq_length {seq}, micro_batch_size {batch}")
