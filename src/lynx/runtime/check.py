"""Helpers shared by `lynx train`, the correctness tests and the benchmarks: the planner's view of a
runtime layer (ModelSpec / ParallelSpec / LayerGraph / per-method stage policy) and one training step
under a micro-batch schedule, returning the loss and every parameter gradient."""

from __future__ import annotations

from typing import Any

import torch

from lynx.api import make_problem
from lynx.graph import LayerGraph
from lynx.memory import predicted_activation_bytes as _predicted
from lynx.methods import get_method
from lynx.policy.base import RecomputePolicy
from lynx.problem import PlanOptions, PlanProblem
from lynx.runtime.engine import RecomputeEngine
from lynx.runtime.layer import LayerConfig
from lynx.runtime.model import GPTModel, synthetic_batch
from lynx.schedule import Action, ActionKind, derive_facts, schedule_1f1b
from lynx.spec import ModelSpec, ParallelSpec, load_hardware


def model_spec(cfg: Any, num_layers: int, vocab: int, name: str = "runtime") -> ModelSpec:
    """The planner's view of a runtime layer config (a family's config may say it itself: `model_spec`)."""
    if hasattr(cfg, "model_spec"):
        return cfg.model_spec(num_layers, vocab, name)  # type: ignore[no-any-return]
    return ModelSpec(name=name, num_layers=num_layers, hidden_size=cfg.hidden_size,
                     num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=cfg.ffn_hidden_size,
                     vocab_size=vocab, max_position_embeddings=max(cfg.seq_length, 8),
                     dropout=cfg.dropout_p > 0, attention="flash" if cfg.core_attn else "standard")


def problem_for(cfg: LayerConfig, num_layers: int, vocab: int, num_microbatches: int = 1,
                hardware: str = "a100-40g-nvlink", graph: LayerGraph | None = None,
                **opts: Any) -> PlanProblem:
    par = ParallelSpec(tp=cfg.tp, pp=1, sequence_parallel=cfg.sequence_parallel,
                       micro_batch_size=cfg.micro_batch_size,
                       global_batch_size=cfg.micro_batch_size * num_microbatches, seq_length=cfg.seq_length)
    return make_problem(model_spec(cfg, num_layers, vocab), load_hardware(hardware), par, PlanOptions(**opts),
                        graph=graph)


def method_policy(method: str, problem: PlanProblem) -> RecomputePolicy:
    """Stage 0's policy from a registered planning method (none, full, selective, uniform, block, lynx...)."""
    return get_method(method).fn(problem).policies[0]


def train_step(model: GPTModel, num_microbatches: int, engine: RecomputeEngine | None = None,
               in_flight: int = 1, vocab: int | None = None, seed: int = 0,
               batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> float:
    """One iteration's forward and backward (no optimizer step); returns the mean loss.

    `in_flight` > 1 runs the 1F1B order a pipeline's first stage sees (F0 .. F(k-1), then B0 F(k) B1 ...),
    so forward windows of later passes exist; PP = 1 training uses 1 (F0 B0 F1 B1 ...)."""
    cfg = model.cfg
    dev = next(model.parameters()).device
    v = vocab or model.wte.shape[0]
    if batches is None:
        batches = [synthetic_batch(v, cfg.micro_batch_size, cfg.seq_length, j, seed, dev)
                   for j in range(num_microbatches)]
    losses: dict[int, torch.Tensor] = {}
    total = 0.0
    for a in stage_order(num_microbatches, in_flight):
        if a.kind is ActionKind.F:
            tok, lab = batches[a.microbatch]
            losses[a.microbatch] = model(tok, lab, a.microbatch, engine)
            continue
        loss = losses.pop(a.microbatch)
        (loss / num_microbatches).backward()
        total += float(loss.detach())
    if engine is not None:
        engine.end_step()
    model.allreduce_sp_grads()
    return total / num_microbatches


def stage_order(num_microbatches: int, in_flight: int) -> tuple[Action, ...]:
    """The action list of the first stage of a 1F1B pipeline `in_flight` stages deep (lynx.schedule's)."""
    k = max(1, min(in_flight, num_microbatches))
    return schedule_1f1b(k, num_microbatches)[0]


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def runtime_graph(graph: LayerGraph, dtype: torch.dtype) -> LayerGraph:
    """The analytic graph (16-bit activations) with activation bytes rescaled to the runtime's dtype;
    dropout masks stay 1 byte per element."""
    from dataclasses import replace

    f = torch.empty((), dtype=dtype).element_size() / 2.0
    ops = tuple(replace(o, out_bytes=o.out_bytes * f) for o in graph.ops)
    return replace(graph, ops=ops, input_bytes=graph.input_bytes * f)


def layernorm_stats_bytes(cfg: Any, keep: frozenset[str]) -> int:
    """Mean and 1/std per token that a kept LayerNorm's backward also reads (fp32), which the graph folds
    into the op as negligible: 2 x 4 bytes per token per kept LayerNorm (a config may name its own norm ops
    and bytes per token: RMSNorm keeps 4)."""
    tok = cfg.seq_length * cfg.micro_batch_size // (cfg.tp if cfg.sequence_parallel else 1)
    per = getattr(cfg, "norm_stats_bytes", 2 * 4)
    return sum(per * tok for n in getattr(cfg, "norm_ops", ("ln1", "ln2")) if n in keep)


def predicted_activation_bytes(graph: LayerGraph, policy: RecomputePolicy, cfg: LayerConfig,
                               in_flight: int = 1) -> tuple[float, float]:
    """The planner's view of what the engine measures, from `lynx.memory` on `graph` (bytes in the
    runtime's dtype): (held after the forward passes in flight, peak held including what backward
    restores). In-flight count and forward windows are the schedule's facts for the first stage of an
    `in_flight`-deep 1F1B pipeline. LayerNorm statistics are added as the runtime holds them."""
    k = max(1, in_flight)
    facts = derive_facts(schedule_1f1b(k, k)).of(0)
    ln = [float(layernorm_stats_bytes(cfg, lp.keep)) for lp in policy.layers]
    per_op = {n: float(layernorm_stats_bytes(cfg, frozenset({n}))) for n in graph.names}
    return _predicted(graph, policy.layers, ln, facts.in_flight, facts.has_fwd_windows,
                      {n: b for n, b in per_op.items() if b})
