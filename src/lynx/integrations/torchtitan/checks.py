"""A plan applied to a model it does not describe is an error, never a silent difference.

At apply time `check_model` reads what torchtitan made of the model part -- its own ``ParallelDims`` (the
closure ``Module.parallelize`` left on each module), the module plans (sequence parallelism from the attention
norm's input layout), the weights' shards (the TP degree actually applied), the GEMM modules' classes (Float8
and other converters), the attention kernel, compiled blocks -- and compares each with the plan
(`lynx.export.titan_assumes.PlanAssumes`, from a plan file or the engine's layer table) and with what the
caller passed (the TP group, ``sequence_parallel``). `check_batch` compares the first forward's activations
(micro-batch, sequence, dtype) with the plan. Each refusal is one line naming the plan's value and the
model's. `guard_compile` makes torchtitan's later ``block.compile(...)`` (``compile.enable``, after its
activation checkpointing) a refusal instead of a crash at the first step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lynx.export.titan_assumes import PlanAssumes
from lynx.integrations.torchtitan import _fence

WHO = "lynx.integrations.torchtitan"


class PlanMismatch(ValueError):
    """The model is not the one the plan describes (one line: what, the plan's value, the model's)."""


def mismatch(what: str, plan: Any, model: Any, hint: str = "") -> PlanMismatch:
    return PlanMismatch(f"{WHO}: {what}: the plan has {plan}, the model {model}" + (f" ({hint})" if hint else ""))


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What torchtitan made of one model part, read at apply time."""

    tp: int
    """TP degree the blocks' weights are sharded by (global heads x head dim / local wqkv rows)."""
    sequence_parallel: bool | None
    """torchtitan's module plan: SP, no SP, or None (no module plans)."""
    parallel_dims: Any
    """torchtitan's ParallelDims for the part (None: it was not parallelized by torchtitan)."""
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int


def read_model(model_part: nn.Module, blocks: Sequence[nn.Module]) -> ModelFacts:
    parts = _fence.block_parts(blocks[0])
    rows = (parts.n_heads + 2 * parts.n_kv_heads) * parts.head_dim
    local = int(parts.wqkv.shape[0])
    tp = rows // local if local and rows % local == 0 else 0
    return ModelFacts(tp=tp, sequence_parallel=_fence.sequence_parallel_of(blocks[0]),
                      parallel_dims=_fence.parallel_dims_of(model_part), hidden_size=parts.dim,
                      num_attention_heads=parts.n_heads, num_query_groups=parts.n_kv_heads,
                      ffn_hidden_size=int(parts.w1.shape[0]) * max(tp, 1))


def check_blocks(blocks: Sequence[tuple[str, nn.Module]]) -> None:
    """Every block: plain Linear GEMMs (the engine calls their weights; a Float8Linear would not run), a
    known attention kernel, not compiled."""
    for name, block in blocks:
        for fqn, cls in _fence.linear_classes(block).items():
            if not _fence.runs_linear_forward(cls):
                raise mismatch(f"layers.{name}.{fqn}", "bf16 GEMMs (Linear)", f"runs {cls.__name__}",
                               "lynx's engine calls the weights directly, so a Float8 / quantized linear would not "
                               "run: leave the model converters (float8, mx) off for a lynx plan")
        kernel = _fence.attention_kernel(block)
        if kernel not in _fence.ATTENTION_KERNELS:
            raise mismatch(f"layers.{name}.attention.inner_attention", "fused attention (" +
                           " or ".join(_fence.ATTENTION_KERNELS) + ")", kernel)
        if _fence.is_compiled(block):
            raise mismatch(f"layers.{name}", "eager blocks", "compiled", COMPILE_HINT)


COMPILE_HINT = ("torch.compile of the blocks (--compile.enable with 'model' in --compile.components) does not "
                "compose with lynx's engine, and Async TP needs it: run without compile")


SHARDING_HINT = ("the model has no module plans: call torchtitan.models.llama3.sharding.set_llama3_sharding_config "
                 "on its config before building and parallelizing it")


def check_parallel(facts: ModelFacts, assumes: PlanAssumes | None, group_size: int | None,
                   sequence_parallel: bool | None) -> bool:
    """Compare the model's TP / SP / degrees with the plan's and the caller's; returns the SP to run."""
    pd = facts.parallel_dims
    if facts.tp == 0:
        raise PlanMismatch(f"{WHO}: the blocks' wqkv rows do not divide heads x head dim evenly: not a TP shard "
                           "torchtitan 0.3.0's Llama 3 plan makes")
    if pd is not None and int(pd.tp) != facts.tp:
        raise mismatch("TP degree", f"torchtitan's mesh TP {pd.tp}", f"weights sharded {facts.tp} ways",
                       SHARDING_HINT)
    if group_size is not None and group_size != facts.tp:
        raise mismatch("TP group", f"a group of {group_size} ranks", f"TP {facts.tp}")
    model_sp = facts.sequence_parallel if facts.tp > 1 else False
    if sequence_parallel is not None and model_sp is not None and facts.tp > 1 and sequence_parallel != model_sp:
        raise mismatch("sequence parallelism", f"sequence_parallel={sequence_parallel}",
                       f"{'SP' if model_sp else 'no SP'} in torchtitan's module plans")
    sp = bool(model_sp if model_sp is not None else (sequence_parallel and facts.tp > 1))
    if assumes is not None:
        _check_against(facts, assumes, sp)
    return sp


def _check_against(facts: ModelFacts, a: PlanAssumes, sp: bool) -> None:
    for what, plan, model in (("hidden size", a.hidden_size, facts.hidden_size),
                              ("attention heads", a.num_attention_heads, facts.num_attention_heads),
                              ("KV heads", a.num_query_groups, facts.num_query_groups),
                              ("FFN width", a.ffn_hidden_size, facts.ffn_hidden_size),
                              ("TP degree", a.tp, facts.tp)):
        if plan != model:
            no_plans = what == "TP degree" and facts.sequence_parallel is None and facts.tp == 1
            raise mismatch(what, plan, model, SHARDING_HINT if no_plans else "")
    if a.sequence_parallel != sp:
        raise mismatch("sequence parallelism", "SP" if a.sequence_parallel else "no SP", "SP" if sp else "no SP",
                       "--parallelism.enable_sequence_parallel must be what the plan was made with")
    pd = facts.parallel_dims
    if pd is None:
        return
    for what, plan, model in (("pipeline degree", a.pp, int(pd.pp)),
                              ("data_parallel_shard_degree", a.dp_shard, int(pd.dp_shard)),
                              ("data_parallel_replicate_degree", a.dp_replicate, int(pd.dp_replicate))):
        if plan != model:
            raise mismatch(what, plan, f"{model} (torchtitan's ParallelDims)")
    if int(getattr(pd, "cp", 1)) > 1:
        raise mismatch("context parallelism", "none", f"CP {pd.cp}")


def check_batch(a: PlanAssumes, x: torch.Tensor, tp: int, sp: bool) -> None:
    """The first forward's block input [batch, sequence (a TP shard with SP), hidden] against the plan."""
    seq = int(x.shape[1]) * (tp if sp else 1)
    for what, plan, model in (("micro-batch", a.micro_batch_size, int(x.shape[0])), ("sequence length",
                              a.seq_length, seq), ("activation bytes", a.activation_bytes, x.element_size())):
        if plan != model:
            raise mismatch(f"{what} of the first forward", plan, f"{model} ({x.dtype})" if "bytes" in what else model)


def guard_compile(block: nn.Module) -> None:
    """Make a later ``block.compile(...)`` (torchtitan's apply_compile, after activation checkpointing) refuse."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise mismatch("torch.compile", "eager blocks", "compiles them", COMPILE_HINT)

    block.compile = refuse  # type: ignore[method-assign]


def unguard_compile(block: nn.Module) -> None:
    block.__dict__.pop("compile", None)


__all__ = ["ModelFacts", "PlanMismatch", "check_batch", "check_blocks", "check_parallel", "guard_compile",
           "read_model", "unguard_compile"]
