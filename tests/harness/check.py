"""Helpers for the runtime's correctness tests and the benchmarks: the planner's view of a runtime layer
config (ModelSpec / problem / a method's stage policy) and parameter gradients."""

from __future__ import annotations

from typing import Any

import torch

from lynx.api import make_problem
from lynx.graph import LayerGraph
from lynx.methods import get_method
from lynx.policy.base import RecomputePolicy
from lynx.problem import PlanOptions, PlanProblem
from lynx.runtime.predict import layernorm_stats_bytes, predicted_activation_bytes, runtime_graph
from lynx.runtime.step import stage_order, train_step
from lynx.spec import ModelSpec, ParallelSpec, load_hardware

__all__ = ["grads_of", "layernorm_stats_bytes", "method_policy", "model_spec", "predicted_activation_bytes",
           "problem_for", "runtime_graph", "stage_order", "train_step"]


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


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
