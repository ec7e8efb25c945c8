"""What the runtime needs from a plan, read through the typed plan objects (`load_plan`, and the prediction
recomputed by `Plan.evaluate`: a plan file's own numbers are never trusted): the family's layer config, the
pipeline layout with one policy per virtual stage, and the predicted time and per-stage peaks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lynx.decisions import validate_layer_policy
from lynx.errors import PlanFormatError
from lynx.graph import per_layer
from lynx.plan import Plan, load_plan, policies_per_virtual_stage
from lynx.problem import PlanProblem
from lynx.runtime.fsdp import FsdpRun, check_fsdp
from lynx.runtime.layers.family import RuntimeFamily, runtime_for
from lynx.runtime.pipeline import LayoutError, PipelineLayout
from lynx.spec import fusion_changes


@dataclass(frozen=True)
class RunPlan:
    """What the runtime needs from a plan, read through the typed plan objects."""

    path: str
    problem: PlanProblem
    method: str
    layout: PipelineLayout
    family: RuntimeFamily
    cfg: Any
    """The family's layer config (`LayerConfig`, `LlamaConfig`)."""
    predicted_time_s: float
    predicted_stage_peaks: tuple[float, ...]
    """The simulator's per-pipeline-rank peak memory (static included), bytes."""
    fsdp: FsdpRun | None = None
    """The plan's data parallelism is torch FSDP2 (`lynx.runtime.fsdp`); None: DDP."""


_FUSIONS_THAT_CHANGE_SAVED_BYTES = ("transformer_impl", "bias_activation_fusion", "norm_fusion")
"""The fusion fields (lynx.families.fusion) whose eager form saves other tensors for backward: local's unfused
core attention, eager SwiGLU's silu(gate), the eager RMSNorm's fp32 copies. The others change only time, which
lynx train measures."""


def load_run(plan_path: str, dtype: torch.dtype, core_attn: bool) -> RunPlan:
    problem, result = load_plan(plan_path)
    par, model = problem.parallel, problem.model
    family = runtime_for(model)  # the plan's model family picks the runtime layer and the model's ends
    eager = {k: v for k, v in fusion_changes(model).items() if k in _FUSIONS_THAT_CHANGE_SAVED_BYTES}
    if eager:  # the plan prices what eager kernels save; the runtime's layers save what the fused ones do
        raise PlanFormatError(f"{plan_path}: the plan's model runs {', '.join(f'{k}={v}' for k, v in eager.items())}; "
                              "lynx train builds only the fused layers (TransformerEngine's saved tensors): plan "
                              "with Megatron's default fusions to train it here")
    try:
        cfg = family.config(model, par, dtype, core_attn)
    except ValueError as e:
        raise PlanFormatError(f"{plan_path}: {e}") from None
    kinds = problem.kind_graphs or (("", problem.graph),)
    for kind, graph in kinds:
        names = family.kind_op_names(cfg, kind) if kind and family.kind_op_names else family.op_names(cfg)
        if names != graph.names:
            what = f"{kind} layer ops" if kind else "layer ops"
            raise PlanFormatError(f"{plan_path}: the plan's {what} ({', '.join(graph.names)}) are not this runtime "
                                  f"layer's ({', '.join(names)}); check --core-attn")
    if model.vocab_size % par.tp:
        raise PlanFormatError(f"{plan_path}: vocab_size {model.vocab_size} is not divisible by tp {par.tp}: the "
                              f"runtime's embedding and LM head are vocabulary-parallel (pad the vocabulary to a "
                              f"multiple of {par.tp}, as Megatron's --make-vocab-size-divisible-by does)")
    vpp = problem.options.vpp
    fsdp = check_fsdp(plan_path, problem.options.dp_sharding, par.tp, par.pp, vpp, par.cp, par.dp)
    virtual = tuple(result.partition.chunks or result.partition.layers_per_stage)
    try:
        layout = PipelineLayout(tp=par.tp, pp=par.pp, dp=par.dp, vpp=vpp, layers_per_stage=virtual,
                                policies=policies_per_virtual_stage(tuple(result.policies), virtual, par.pp, vpp),
                                num_microbatches=par.num_microbatches, ep=par.ep,
                                etp=par.expert_tp if model.is_moe else 1, experts=model.is_moe)
    except LayoutError as e:
        raise PlanFormatError(f"{plan_path}: {e}") from None
    ctxs = problem.stage_contexts(result.partition)
    for s, (pol, ctx) in enumerate(zip(result.policies, ctxs, strict=True)):
        graphs = per_layer(problem.graphs_for(ctx), len(pol.layers))  # each layer's graph, by its kind
        for i, (lp, graph) in enumerate(zip(pol.layers, graphs, strict=True)):
            errs = validate_layer_policy(graph, lp, has_fwd_windows=True)
            if errs:
                raise PlanFormatError(f"{plan_path}: stage {s} layer {i}: " + "; ".join(errs))
    pred = Plan.evaluate(problem, result, record=False).prediction
    return RunPlan(plan_path, problem, result.method, layout, family, cfg, pred.iteration_time_s,
                   tuple(st.peak_memory_bytes for st in pred.stages), fsdp)
