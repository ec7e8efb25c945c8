"""Where a stage's memory goes: the closed-form peak of `lynx.cost.memory` split into its terms, and the static
part split by buffer (`lynx.cost.static_memory`). What `lynx memory` prints. No torch.

The activation terms come from `lynx.cost.memory` through ONE adapter, `activation_terms`; the breakdown must
sum to `memory.stage_peak_bytes` (tested), so the two cannot drift apart unseen.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from lynx.cost.fsdp import sharded_static
from lynx.cost.static_memory import StaticBreakdown, stage_static
from lynx.decisions import LayerPolicy, StageContext
from lynx.graph import Graphs
from lynx.plan import Plan
from lynx.stack import as_kinds


@dataclass(frozen=True, slots=True)
class ActivationTerms:
    """The activation side of `memory.stage_peak_bytes`, term by term, in bytes."""

    per_microbatch: float
    """Retained by the stage's layers for one micro-batch (inputs and kept ops)."""
    in_flight: int
    """Micro-batches held at the peak under 1F1B: min(p - s, m)."""
    fwd_window: float
    """Recomputed in forward windows (phases 1, 2) and held until the backward: the paper's M_fwd_comm."""
    working_set: float
    """max(forward working set, backward working set): what one layer's forward drops or one backward
    restores (including a uniform chunk's re-forward)."""
    grad_workspace: float
    """Gradient buffers alive during one op's backward."""
    held: float
    """The layers' retained bytes of every in-flight micro-batch (interleaved: each chunk's own count)."""
    embedding_per_microbatch: float
    """The first stage's embedding dropout mask, per in-flight micro-batch."""
    embedding: float
    """The embedding masks of every in-flight micro-batch."""
    logits: float
    """The last stage's logits and their fp32 copy for the loss (with DeepSeek-V3's multi-token prediction, its
    layers' activations and logits too: `memory.mtp_bytes`)."""
    offloaded_per_microbatch: float = 0.0
    """The part of `per_microbatch` offloaded to host memory (docs/offload.md): on the device for one micro-batch
    only, so `held` counts it once."""
    host: float = 0.0
    """Pinned host memory the offloaded activations of every in-flight micro-batch take, per GPU."""
    chunk_microbatches: int = 0
    """Interleaved stages: the most (chunk, micro-batch) pairs alive at once, summed over the stage's chunks (the
    schedule's peak live vector); `in_flight` is then only the largest single chunk's count. 0: one chunk."""


def activation_terms(graph: Graphs, layers: tuple[LayerPolicy, ...], ctx: StageContext) -> ActivationTerms:
    """The closed form's activation terms, from `lynx.cost.memory`'s pieces (the ones `stage_peak_bytes` adds)."""
    from lynx.cost.memory import held_bytes, host_bytes, layer_memories, stage_lifetimes

    mems = layer_memories(graph, layers)
    work_f = max((m.dropped for m in mems), default=0.0)
    held_fwd, work_b, fwd_tr = stage_lifetimes(graph, layers, ctx)
    embedding = ctx.extra_in_flight * ctx.extra_retained_bytes
    return ActivationTerms(
        per_microbatch=sum(m.retained for m in mems),
        in_flight=ctx.in_flight,
        held=held_bytes(mems, ctx) - embedding,
        embedding=embedding,
        fwd_window=held_fwd,
        working_set=max(work_f + fwd_tr, work_b),
        grad_workspace=ctx.grad_workspace_bytes,
        embedding_per_microbatch=ctx.extra_retained_bytes,
        logits=ctx.extra_transient_bytes,
        offloaded_per_microbatch=sum(m.offloaded for m in mems),
        host=host_bytes(mems, ctx),
        chunk_microbatches=round(ctx.peak_weighted((1.0,) * len(ctx.chunk_layers))) if ctx.chunk_layers else 0,
    )


@dataclass(frozen=True, slots=True)
class StageMemory:
    """One stage's peak, by term. `peak` is the closed form the planner constrains."""

    stage: int
    num_layers: int
    static: StaticBreakdown
    act: ActivationTerms
    budget_bytes: float
    simulated_peak_bytes: float | None = None
    """The event simulator's peak for the same plan (at most `peak`)."""

    @property
    def activations(self) -> float:
        return self.act.held

    @property
    def transient(self) -> float:
        return self.act.working_set + self.act.grad_workspace

    @property
    def embedding_logits(self) -> float:
        return self.act.embedding + self.act.logits

    def terms(self) -> dict[str, float]:
        """The stacked terms, bottom first; they sum to `peak`."""
        return {
            "parameters": self.static.param_bytes,
            "gradients": self.static.grad_bytes,
            "optimizer state": self.static.optimizer_bytes,
            "activations": self.activations,
            "forward windows": self.act.fwd_window,
            "transient": self.transient,
            "embedding / logits": self.embedding_logits,
        }

    @property
    def peak(self) -> float:
        """The terms' sum, or the optimizer step's own peak where that is higher (static memory and the fp16
        recipe's main-gradient copy, `StaticBreakdown.step_bytes`, with no activation alive)."""
        return max(sum(self.terms().values()), self.static.total + self.static.step_bytes)

    @property
    def headroom(self) -> float:
        return self.budget_bytes - self.peak

    def to_dict(self) -> dict[str, Any]:
        st = self.static
        return {
            "stage": self.stage,
            "num_layers": self.num_layers,
            "terms_bytes": self.terms(),
            "peak_bytes": self.peak,
            "budget_bytes": self.budget_bytes,
            "headroom_bytes": self.headroom,
            "simulated_peak_bytes": self.simulated_peak_bytes,
            "activations": asdict(self.act),
            "static": {
                "recipe": asdict(st.recipe),
                "distributed_optimizer": st.distributed_optimizer,
                "dp": st.dp,
                "params": asdict(st.params),
                "param_bytes": st.param_bytes,
                "grad_bytes": st.grad_bytes,
                "optimizer_bytes": st.optimizer_bytes,
                "step_only_bytes": st.step_bytes,
            },
        }


def stage_memories(plan: Plan) -> tuple[StageMemory, ...]:
    """Per stage of an evaluated `lynx.plan.Plan`: static by buffer and activations by term."""
    problem, result = plan.problem, plan.result
    ctxs = problem.stage_contexts(result.partition)
    sims = plan.sim.stages
    out = []
    for s, (ctx, pol) in enumerate(zip(ctxs, result.policies, strict=True)):
        static = stage_static(problem.model, problem.parallel, s, ctx.num_layers, problem.static_recipe,
                              problem.options.distributed_optimizer, kinds=as_kinds(ctx.kinds))
        ds = problem.dp_sharding
        if ds is not None:  # FSDP (torchtitan's included): its shards, gathered layers counted as parameters
            sh = sharded_static(problem.model, problem.parallel, s, ctx.num_layers, problem.static_recipe, ds,
                                problem.options.bytes_per_param)
            static = replace(static, param_bytes=sh.params + sh.in_flight, grad_bytes=sh.grads,
                             optimizer_bytes=sh.optimizer, step_bytes=0.0)  # the shards are priced whole
        elif static.step_bytes and not ctx.step_bytes:  # a step that does not fit, charged as static (the context's)
            static = replace(static, optimizer_bytes=static.optimizer_bytes + static.step_bytes, step_bytes=0.0)
        out.append(StageMemory(s, ctx.num_layers, static, activation_terms(problem.graphs_for(ctx), pol.layers, ctx),
                               ctx.budget_bytes, sims[s].peak_memory_bytes if s < len(sims) else None))
    return tuple(out)
