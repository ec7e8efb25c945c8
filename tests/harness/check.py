"""Helpers for the runtime's correctness tests: gradients to compare, and (from the benchmarks' harness,
`benchmarks/_harness.py`, which the measurements share) the planner's view of a runtime layer config and one
training step of a single-stage model under a micro-batch order."""

from __future__ import annotations

import torch

from benchmarks._harness import method_policy, model_spec, problem_for, stage_order, train_step
from lynx.runtime.predict import predicted_activation_bytes, runtime_extra_bytes, runtime_graph

__all__ = ["grads_of", "runtime_extra_bytes", "method_policy", "model_spec", "predicted_activation_bytes",
           "problem_for", "runtime_graph", "stage_order", "train_step"]


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
