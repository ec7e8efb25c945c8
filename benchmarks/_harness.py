"""The benchmarks' own harness for runtime measurements: the planner's view of a runtime layer config
(ModelSpec, problem, a method's stage policy) and one training step of a single-stage model under a
micro-batch order (the order a pipeline's first stage sees). The runtime's correctness tests use the same
functions through `tests/harness/check.py`; what only tests need (gradients to compare) stays there."""

from __future__ import annotations

from typing import Any

import torch

from lynx.api import make_problem
from lynx.decisions import RecomputePolicy
from lynx.graph import LayerGraph
from lynx.methods import get_method
from lynx.problem import PlanOptions, PlanProblem
from lynx.runtime.engine import RecomputeEngine
from lynx.runtime.layers.gpt_model import synthetic_batch
from lynx.schedule import Action, ActionKind, schedule_1f1b
from lynx.spec import ModelSpec, ParallelSpec, load_hardware

__all__ = ["method_policy", "model_spec", "problem_for", "stage_order", "train_step"]


def model_spec(cfg: Any, num_layers: int, vocab: int, name: str = "runtime") -> ModelSpec:
    """The planner's view of a runtime layer config (a family's config may say it itself: `model_spec`)."""
    if hasattr(cfg, "model_spec"):
        return cfg.model_spec(num_layers, vocab, name)  # type: ignore[no-any-return]
    return ModelSpec(name=name, num_layers=num_layers, hidden_size=cfg.hidden_size,
                     num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=cfg.ffn_hidden_size,
                     vocab_size=vocab, max_position_embeddings=max(cfg.seq_length, 8),
                     dropout=cfg.dropout_p > 0, attention="flash" if cfg.core_attn else "standard")


def problem_for(cfg: Any, num_layers: int, vocab: int, num_microbatches: int = 1,
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


def train_step(model: Any, num_microbatches: int, engine: RecomputeEngine | None = None,
               in_flight: int = 1, vocab: int | None = None, seed: int = 0,
               batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> float:
    """One iteration's forward and backward (no optimizer step); returns the mean loss.

    `in_flight` > 1 runs the 1F1B order a pipeline's first stage sees (F0 .. F(k-1), then B0 F(k) B1 ...),
    so forward windows of later passes exist; PP = 1 training uses 1 (F0 B0 F1 B1 ...)."""
    cfg = model.cfg
    dev = next(model.parameters()).device
    v = vocab or getattr(model, "vocab_size", None) or model.wte.shape[0]  # wte is this TP rank's rows
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
